#!/usr/bin/env python3
"""Measure which capabilities (and which seccomp profile) CRIU needs for process mode.

One *cycle* is what cairn does to a workload, run entirely inside a reduced privilege set —
the set a container runtime would grant a uid-0 process: only the given capabilities in the
bounding, permitted, effective, inheritable and ambient sets:

1. write ``/proc/sys/kernel/ns_last_pid`` (cairn moves the PID cursor before it starts a
   workload; needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE);
2. start a workload in its own session (``tests/support/counter_steps.py``: appends a counter
   to a file, in append mode, every 50 ms);
3. ``criu dump -t PID -D DIR --leave-running --manage-cgroups=ignore``;
4. kill the workload;
5. ``criu restore -D DIR --restore-detached --restore-sibling --manage-cgroups=ignore --pidfile F``;
6. check that the restored process, with the same PID, counts on from where it was dumped.

Each cycle runs in a private mount namespace with a fresh tmpfs on ``/run``, so CRIU's kerndat
cache (``/run/criu.kdat``) is computed under the reduced set, as it would be in a container,
and a cache computed with fewer privileges never leaks to the host's other CRIU runs. The
capabilities are dropped with ``capsh``; the seccomp filter, when asked for, is installed by a
small libseccomp helper (``scripts/seccomp/seccomp_exec.c``, compiled at run time with ``cc``)
before the capabilities are dropped, as runc does.

With no arguments the script measures (about 7 minutes on 2 cores), for each of four ways to
run CRIU (CONFIGS: criu as cairn runs it, "plain", or with ``--unprivileged``; each with and
without no_new_privs, i.e. Kubernetes' ``allowPrivilegeEscalation: false``):

- the minimal set: start from every capability this host grants, drop each in turn (in
  capability-number order) and keep it dropped if the cycle still passes; then, for each
  capability left, what fails without it;
- candidate sets people use (CHECKPOINT_RESTORE+SYS_PTRACE, SYS_ADMIN+SYS_PTRACE, Docker's
  default set, with SYS_PTRACE, with CHECKPOINT_RESTORE), and the minimal set under a
  read-only ``/proc/sys`` (what runc mounts for a container that is not privileged);
- seccomp: the same cycles under ``scripts/seccomp/default-like.json`` (an approximation of
  containerd's default profile, i.e. Kubernetes' RuntimeDefault); when one fails, which
  syscalls of the profile block it (found by letting every denied syscall fail with errno
  1000+its number, then re-checked with the profile's real EPERM).

It prints a table, then one line of JSON with every result. Run it as root with the project's
venv python::

    sudo .venv/bin/python scripts/criu_capabilities.py            # the whole measurement
    sudo .venv/bin/python scripts/criu_capabilities.py --quick    # recheck MEASURED_MINIMAL + candidates
    sudo .venv/bin/python scripts/criu_capabilities.py --cycle SETPCAP,CHECKPOINT_RESTORE --unprivileged \\
        [--no-new-privs] [--ro-proc-sys] [--seccomp scripts/seccomp/default-like.json] [--keep]

Needs: ``criu`` (scripts/build_criu.sh), ``capsh`` (Debian/Ubuntu: ``apt-get install
libcap2-bin``), ``unshare`` (util-linux), and for the seccomp part ``cc`` and the libseccomp
headers (``apt-get install gcc libseccomp-dev``). See docs/adr/0008-process-mode-privileges.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cairn.process.doctor import CAPABILITY_NAMES

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
COUNTER = REPO / "tests" / "support" / "counter_steps.py"
SECCOMP_DIR = HERE / "seccomp"
DEFAULT_PROFILE = SECCOMP_DIR / "default-like.json"
ALLOW_ALL_PROFILE = SECCOMP_DIR / "allow-all.json"  # a filter that denies nothing
HELPER_SRC = SECCOMP_DIR / "seccomp_exec.c"
NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"

CAP_NAMES = CAPABILITY_NAMES  # index = capability number (linux/capability.h)

# Docker's and containerd's default grant (moby oci/caps/defaults.go, containerd oci/spec.go).
DOCKER_DEFAULT: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)

# What the full measurement found, per way of running criu (CONFIGS below; recorded in
# docs/adr/0008-process-mode-privileges.md); tests/integration/process/test_privileges.py
# checks it on every CI run.
MEASURED_MINIMAL: dict[str, tuple[str, ...]] = {
    "plain": ("CAP_SETPCAP", "CAP_NET_ADMIN", "CAP_SYS_CHROOT", "CAP_SYS_ADMIN", "CAP_SYS_TIME"),
    "plain+nnp": ("CAP_NET_ADMIN", "CAP_SYS_CHROOT", "CAP_SYS_ADMIN", "CAP_SYS_TIME"),
    "unprivileged": ("CAP_SETPCAP", "CAP_CHECKPOINT_RESTORE"),
    "unprivileged+nnp": ("CAP_CHECKPOINT_RESTORE",),
}

# For each capability of each minimal set: where the cycle fails without it, and words of
# the CRIU error it then logs (the test checks these; the ADR explains them).
_PLAIN_WHY = {
    "CAP_SETPCAP": ("restore", "Unable to drop capability"),  # restorer trims the bounding set
    "CAP_NET_ADMIN": ("restore", "SO_SNDBUFFORCE"),  # sockets: forced buffer sizes
    "CAP_SYS_CHROOT": ("restore", "Can't change root"),  # restores root with chroot
    "CAP_SYS_ADMIN": ("dump", "capability 21 missing"),  # neither SYS_ADMIN nor CHECKPOINT_RESTORE
    "CAP_SYS_TIME": ("restore", "monotonic clock offset"),  # new time namespace, clock offsets
}
WHY_NEEDED: dict[str, dict[str, tuple[str, str]]] = {
    "plain": _PLAIN_WHY,
    "plain+nnp": {k: v for k, v in _PLAIN_WHY.items() if k != "CAP_SETPCAP"},
    "unprivileged": {"CAP_SETPCAP": _PLAIN_WHY["CAP_SETPCAP"],
                     "CAP_CHECKPOINT_RESTORE": ("dump", "capability 21 missing")},
    "unprivileged+nnp": {"CAP_CHECKPOINT_RESTORE": ("dump", "capability 21 missing")},
}

# What ADR 0008 recommends for Kubernetes (criu run as cairn runs it): the runtime's default
# set (which holds SETPCAP and SYS_CHROOT) plus these. SYS_PTRACE is not needed on this host
# (no Yama) but is where Yama's ptrace_scope is 1: CRIU is not the workload's ancestor.
RECOMMENDED_ADD: tuple[str, ...] = ("CAP_SYS_ADMIN", "CAP_SYS_TIME", "CAP_NET_ADMIN", "CAP_SYS_PTRACE")
RECOMMENDED: tuple[str, ...] = (*DOCKER_DEFAULT, *RECOMMENDED_ADD)

DOCKER_PTRACE_CR = (*DOCKER_DEFAULT, "CAP_SYS_PTRACE", "CAP_CHECKPOINT_RESTORE")
CANDIDATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("CHECKPOINT_RESTORE+SYS_PTRACE", ("CAP_CHECKPOINT_RESTORE", "CAP_SYS_PTRACE")),
    ("SYS_ADMIN+SYS_PTRACE", ("CAP_SYS_ADMIN", "CAP_SYS_PTRACE")),
    ("docker default", DOCKER_DEFAULT),
    ("docker default+SYS_PTRACE", (*DOCKER_DEFAULT, "CAP_SYS_PTRACE")),
    ("docker default+SYS_PTRACE+CHECKPOINT_RESTORE", DOCKER_PTRACE_CR),
    ("docker default+SYS_ADMIN+SYS_TIME+NET_ADMIN+SYS_PTRACE (ADR 0008)", RECOMMENDED),
)

INSTALL_HINTS = {
    "capsh": "capsh not found: install it with `apt-get install libcap2-bin` (Debian/Ubuntu)",
    "unshare": "unshare not found: install util-linux",
    "cc": "cc not found: install it with `apt-get install gcc`",
    "seccomp.h": "libseccomp headers not found: install them with `apt-get install libseccomp-dev`",
    "criu": "criu not found: run `sudo bash scripts/build_criu.sh` (or set CRIU=/path/to/criu)",
}

ERRNO_BASE = 1000  # discovery: a denied syscall fails with errno ERRNO_BASE + its number


# -- capabilities -----------------------------------------------------------------------------

def cap_number(name: str) -> int:
    return CAP_NAMES.index(name)


def caps_of_mask(mask: int) -> list[str]:
    return [name for bit, name in enumerate(CAP_NAMES) if mask >> bit & 1]


def host_capabilities() -> list[str]:
    """Every capability this process may pass on (its bounding set), in number order."""
    status = Path("/proc/self/status").read_text()
    bnd = int(re.search(r"^CapBnd:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    eff = int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = len(CAP_NAMES) - 1
    return [c for c in caps_of_mask(bnd & eff) if cap_number(c) <= last]


def short(caps: Iterable[str]) -> str:
    names = sorted(caps, key=cap_number)
    return "+".join(c.removeprefix("CAP_") for c in names) if names else "(none)"


def capsh_argv(capsh: str, caps: Sequence[str], all_caps: Sequence[str], *, no_new_privs: bool) -> list[str]:
    """capsh arguments that leave exactly ``caps`` in every set of a uid-0 process.

    For uid 0 the kernel recomputes permitted = bounding | inheritable at exec, so the bounding
    set is what really limits it; the others are set too, as runc sets them."""
    keep = sorted(set(caps), key=cap_number)
    drop = [c for c in all_caps if c not in keep]
    argv = [capsh]
    if drop:
        argv.append("--drop=" + ",".join(c.lower() for c in drop))  # bounding set (needs SETPCAP: still there)
    argv.append("--caps=" + (",".join(c.lower() for c in keep) + "=eip" if keep else "="))
    if keep:
        argv.append("--addamb=" + ",".join(c.lower() for c in keep))
    if no_new_privs:
        argv.append("--no-new-privs")
    return argv


# -- seccomp ----------------------------------------------------------------------------------

_helper_cache: dict[str, str] = {}


def seccomp_helper(build_dir: Path) -> str:
    """Compile scripts/seccomp/seccomp_exec.c once per run; returns the binary's path."""
    if "path" in _helper_cache and Path(_helper_cache["path"]).exists():
        return _helper_cache["path"]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit(INSTALL_HINTS["cc"])
    if not Path("/usr/include/seccomp.h").exists():
        raise SystemExit(INSTALL_HINTS["seccomp.h"])
    out = build_dir / "seccomp_exec"
    done = subprocess.run([cc, "-O2", "-o", str(out), str(HELPER_SRC), "-lseccomp"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"compiling {HELPER_SRC} failed:\n{done.stderr}")
    _helper_cache["path"] = str(out)
    return str(out)


def syscall_names(helper: str) -> dict[int, str]:
    done = subprocess.run([helper, "--names"], capture_output=True, text=True, check=True)
    return {int(nr): name for nr, name in (line.split() for line in done.stdout.splitlines())}


def _applies(rule: dict, caps: set[str]) -> bool:
    inc, exc = rule.get("includes", {}), rule.get("excludes", {})
    if inc.get("caps") and not set(inc["caps"]) <= caps:
        return False
    if exc.get("caps") and set(exc["caps"]) & caps:
        return False
    if inc.get("arches") and "amd64" not in inc["arches"]:
        return False
    if exc.get("arches") and "amd64" in exc["arches"]:
        return False
    return True


def resolve_profile(profile: dict, caps: Iterable[str], *, extra_allow: Iterable[str] = (),
                    numbered_errno: dict[int, str] | None = None) -> str:
    """The rules text for seccomp_exec: ``profile`` (Docker/OCI JSON) as it applies to a
    container granted ``caps``, plus ``extra_allow`` syscalls. With ``numbered_errno`` (the
    native syscall table), every syscall the profile leaves to the default action fails with
    errno ERRNO_BASE + its number instead, so a log line names it."""
    caps = set(caps)
    act = profile["defaultAction"]
    lines: list[str] = []
    if act == "SCMP_ACT_ERRNO":
        lines.append(f"default errno {profile.get('defaultErrnoRet', 1)}")
    elif act == "SCMP_ACT_ALLOW":
        lines.append("default allow")
    elif act == "SCMP_ACT_LOG":
        lines.append("default log")
    else:
        raise ValueError(f"unsupported defaultAction {act}")
    for arch in profile.get("architectures", []):
        name = {"SCMP_ARCH_X86": "x86", "SCMP_ARCH_X32": "x32"}.get(arch)
        if name:
            lines.append(f"arch {name}")
    ruled: set[str] = set()
    for rule in profile["syscalls"]:
        if not _applies(rule, caps):
            continue
        for name in rule["names"]:
            ruled.add(name)
            if rule["action"] == "SCMP_ACT_ERRNO":
                lines.append(f"errno {name} {rule.get('errnoRet', profile.get('defaultErrnoRet', 1))}")
            elif rule["action"] != "SCMP_ACT_ALLOW":
                raise ValueError(f"unsupported action {rule['action']}")
            elif not rule.get("args"):
                lines.append(f"allow {name}")
            else:
                (arg,) = rule["args"]  # the default profiles use one comparison per rule
                if arg["op"] == "SCMP_CMP_EQ":
                    lines.append(f"allow {name} {arg['index']} eq {arg['value']}")
                elif arg["op"] == "SCMP_CMP_MASKED_EQ":
                    lines.append(f"allow {name} {arg['index']} masked_eq {arg['value']} {arg.get('valueTwo', 0)}")
                else:
                    raise ValueError(f"unsupported op {arg['op']}")
    for name in extra_allow:
        ruled.add(name)
        lines.append(f"allow {name}")
    if numbered_errno is not None:
        for nr, name in sorted(numbered_errno.items()):
            if name not in ruled:
                lines.append(f"errno {name} {ERRNO_BASE + nr}")
    return "\n".join(lines) + "\n"


# -- one cycle ----------------------------------------------------------------------------------

@dataclass
class Cycle:
    caps: list[str]
    ok: bool = False
    stage: str = ""  # where it failed: ns_last_pid, start, dump, restore, continue, harness
    error: str = ""  # the CRIU error line that stopped it (or the harness's words)
    ns_last_pid: str = ""  # "ok" or why writing it failed
    criu_opts: list[str] = field(default_factory=list)  # e.g. ["--unprivileged"]
    seccomp: str | None = None
    extra_allow: list[str] = field(default_factory=list)
    no_new_privs: bool = False
    ro_proc_sys: bool = False
    seconds: float = 0.0
    seen_caps: str = ""  # CapEff as the cycle saw it (sanity check)
    seccomp_mode: str = ""  # "Seccomp:" as the cycle saw it
    errnos: list[int] = field(default_factory=list)  # discovery: ERRNO_BASE+nr seen in the logs
    workdir: str | None = None


# Error lines that only report that something before them failed.
_GENERIC = re.compile(r"FAILED|failed when initializing kerndat|Could not initialize kernel features|"
                      r"Can't wait or bad status|Unexpected error: -1|exited, status=|was killed|"
                      r"Killing processes because|BUG at|in unexpected state|Task stopped with|"
                      r"Can't stop all tasks|killed by signal")
# Errors that are often only the echo of a helper's death (the helper logs the cause itself).
_WEAK = re.compile(r"Unable to detach from|Can't attach to init")


def _error_lines(log: str) -> list[str]:
    found = []
    for line in log.splitlines():
        if re.search(r"\bError \(", line):
            found.append(re.sub(r"^\(\s*[\d.]+\)\s*", "", line).strip())
    return found


def _fatal(errors: list[str]) -> str | None:
    """The error that stopped CRIU: the last specific one (CRIU logs some failed probes as
    errors and carries on, so the first is often harmless)."""
    specific = [e for e in errors if not _GENERIC.search(e)]
    strong = [e for e in specific if not _WEAK.search(e)]
    return (strong or specific or errors or [None])[-1]


def _strays(workdir: Path) -> list[int]:
    """PIDs of processes whose command line names ``workdir`` (the cycle's own workloads)."""
    mine = []
    needle = str(workdir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                mine.append(int(entry.name))
        except OSError:
            continue
    return [p for p in mine if p != os.getpid()]


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _kill_strays(workdir: Path) -> list[int]:
    killed = []
    for pid in _strays(workdir):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while killed and not all(_gone(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def find_criu() -> str | None:
    for candidate in (os.environ.get("CRIU"), shutil.which("criu"), "/usr/local/sbin/criu"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_tools(*, seccomp: bool = False) -> dict[str, str]:
    if os.geteuid() != 0:
        raise SystemExit("run as root: CRIU and capsh need it")
    tools = {"criu": find_criu(), "capsh": shutil.which("capsh"), "unshare": shutil.which("unshare")}
    for name, path in tools.items():
        if path is None:
            raise SystemExit(INSTALL_HINTS[name])
    if seccomp and (shutil.which("cc") is None and shutil.which("gcc") is None):
        raise SystemExit(INSTALL_HINTS["cc"])
    if seccomp and not Path("/usr/include/seccomp.h").exists():
        raise SystemExit(INSTALL_HINTS["seccomp.h"])
    return tools  # type: ignore[return-value]


def run_cycle(caps: Iterable[str], *, profile: Path | None = None, extra_allow: Iterable[str] = (),
              discover: bool = False, no_new_privs: bool = False, ro_proc_sys: bool = False,
              criu_opts: Sequence[str] = (), keep: bool = False, timeout: float = 120,
              python: str | None = None) -> Cycle:
    """One ns_last_pid + dump + kill + restore + continue cycle with exactly ``caps``."""
    tools = require_tools(seccomp=profile is not None)
    all_caps = host_capabilities()
    caps = sorted(set(caps), key=cap_number)
    unknown = [c for c in caps if c not in all_caps]
    if unknown:
        raise SystemExit(f"this host cannot grant {', '.join(unknown)} (not in its bounding set)")
    extra_allow = list(extra_allow)
    result = Cycle(caps=caps, criu_opts=list(criu_opts), seccomp=str(profile.relative_to(REPO) if profile.is_relative_to(REPO) else profile)
                   if profile else None, extra_allow=extra_allow, no_new_privs=no_new_privs, ro_proc_sys=ro_proc_sys)
    workdir = Path(tempfile.mkdtemp(prefix="cairn-caps-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    started = time.monotonic()
    try:
        setup = "mount -t tmpfs -o mode=0755,size=16m cairn-criu-run /run"
        if ro_proc_sys:  # what runc does for a container that is not privileged
            setup += " && mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys"
        argv = [tools["unshare"], "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", setup + ' && exec "$@"', "sh"]
        if profile is not None:
            helper = seccomp_helper(workdir)
            rules = resolve_profile(json.loads(profile.read_text()), caps, extra_allow=extra_allow,
                                    numbered_errno=syscall_names(helper) if discover else None)
            (workdir / "seccomp.rules").write_text(rules)
            argv += [helper, str(workdir / "seccomp.rules"), "--"]
        argv += capsh_argv(tools["capsh"], caps, all_caps, no_new_privs=no_new_privs)
        argv += [f"--shell={python or sys.executable}", "--", str(Path(__file__).resolve()),
                 "--inner", str(workdir), "--criu", tools["criu"]]
        argv += [f"--criu-opt={opt}" for opt in criu_opts]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, check=False)
            harness = (done.stdout + done.stderr).strip()
        except subprocess.TimeoutExpired:
            harness = f"timed out after {timeout}s"
        out = workdir / "result.json"
        if out.exists():
            for key, value in json.loads(out.read_text()).items():
                setattr(result, key, value)
        else:
            result.ok, result.stage = False, "harness"
            result.error = harness.splitlines()[-1] if harness else "no result"
        if discover:
            text = ""
            for name in ("dump.log", "restore.log", "result.json"):
                path = workdir / "images" / name if name.endswith(".log") else workdir / name
                if path.exists():
                    text += path.read_text(errors="replace")
            text += harness
            result.errnos = sorted({int(n) for n in re.findall(r"(?:Unknown error|\[Errno) (1\d{3})", text)
                                    if int(n) - ERRNO_BASE in range(1024)})
    finally:
        _kill_strays(workdir)
        result.seconds = round(time.monotonic() - started, 2)
        if keep or os.environ.get("CAIRN_KEEP_CAPS_RUNS"):
            result.workdir = str(workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


# -- the cycle itself, inside the reduced set -----------------------------------------------------

def _counts(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _wait_for(predicate, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def inner(workdir: Path, criu: str, criu_opts: Sequence[str] = ()) -> int:
    """Runs under capsh (and maybe the seccomp filter); writes workdir/result.json."""
    status = Path("/proc/self/status").read_text()
    res: dict[str, object] = {
        "seen_caps": short(caps_of_mask(int(re.search(r"^CapEff:\s*(\w+)", status, re.M).group(1), 16))),
        "seccomp_mode": (re.search(r"^Seccomp:\s*(\d)", status, re.M) or [None, "?"])[1],
        "ok": False, "stage": "", "error": "",
    }
    images = workdir / "images"
    images.mkdir()
    metrics = workdir / "metrics.txt"
    pidfile = workdir / "restored.pid"

    def finish(stage: str, error: str) -> int:
        res["stage"], res["error"] = stage, error
        if not error:
            res["ok"] = res["ns_last_pid"] == "ok"
            if not res["ok"]:
                res["stage"], res["error"] = "ns_last_pid", str(res["ns_last_pid"])
        (workdir / "result.json").write_text(json.dumps(res))
        return 0

    # 1. the PID cursor, as cairn moves it (write back the value read: no real move)
    try:
        with open(NS_LAST_PID, "r+") as f:
            value = f.read().strip()
            f.seek(0)
            f.write(value)
        res["ns_last_pid"] = "ok"
    except OSError as e:
        res["ns_last_pid"] = f"{type(e).__name__}: [Errno {e.errno}] {e.strerror}"

    def criu_run(*args: str, log: str) -> tuple[int, str]:
        try:
            done = subprocess.run([criu, *args, *criu_opts, "-v4", "-o", log], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=60, check=False)
            rc, console = done.returncode, (done.stdout + done.stderr).strip()
        except subprocess.TimeoutExpired:
            rc, console = -1, "criu timed out after 60s"
        text = (images / log).read_text(errors="replace") if (images / log).exists() else ""
        if rc == 0:
            return 0, ""
        fatal = _fatal(_error_lines(text))
        if fatal:
            return rc, fatal
        lines = console.splitlines() or text.splitlines() or [f"exit {rc}"]
        said = [ln for ln in lines if re.search(r"needs|missing|Error|denied|not permitted", ln)]
        return rc, re.sub(r"^\(\s*[\d.]+\)\s*", "", (said or lines)[-1]).strip()

    # 2. the workload: own session, no descriptor shared with us, output files in append mode
    with open(workdir / "workload.out", "ab") as out:
        try:
            child = subprocess.Popen([sys.executable, str(COUNTER), str(metrics), "1000000", "0.05"],
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=workdir,
                                     start_new_session=True)
        except OSError as e:
            return finish("start", f"{type(e).__name__}: {e}")
    pid = child.pid
    try:
        if not _wait_for(lambda: len(_counts(metrics)) >= 5, 20):
            return finish("start", "the workload did not count to 5 in 20 s")
        # 3. dump, leaving it running
        rc, err = criu_run("dump", "-t", str(pid), "-D", str(images), "--leave-running",
                           "--manage-cgroups=ignore", log="dump.log")
        if rc:
            return finish("dump", err)
        # 4. kill it (and reap it: restore needs its PID free)
        child.kill()
        child.wait(timeout=10)
        at_kill = len(_counts(metrics))
        # 5. restore, as our sibling-child, detached
        rc, err = criu_run("restore", "-D", str(images), "--restore-detached", "--restore-sibling",
                           "--manage-cgroups=ignore", "--pidfile", str(pidfile), log="restore.log")
        if rc:
            return finish("restore", err)
        restored = int(pidfile.read_text()) if pidfile.exists() else pid
        try:
            # 6. it counts on, with its own memory: the first new value is where the dump was
            if restored != pid:
                return finish("continue", f"restored as pid {restored}, not {pid}")
            if not _wait_for(lambda: len(_counts(metrics)) >= at_kill + 5, 15):
                return finish("continue", "the restored process did not count on")
            new = _counts(metrics)[at_kill:]
            if new[0] == 0 or new != list(range(new[0], new[0] + len(new))):
                return finish("continue", f"the restored process did not carry on: {new[:8]}")
            return finish("", "")
        finally:
            try:
                os.kill(restored, signal.SIGKILL)
                os.waitpid(restored, 0)  # --restore-sibling: it is our child
            except (ProcessLookupError, ChildProcessError):
                pass
    finally:
        if child.returncode is None:
            child.kill()
            child.wait(timeout=10)


# -- the measurement ---------------------------------------------------------------------------

def find_blocking_syscalls(caps: Sequence[str], profile: Path, criu_opts: Sequence[str] = (), *,  # noqa: ANN201
                           log=print, rounds: int = 8):  # noqa: ANN001
    """Which of the profile's denied syscalls keep the cycle from passing: the fewest that,
    allowed, let it pass (or those found when no more could be)."""
    helper_dir = Path(tempfile.mkdtemp(prefix="cairn-seccomp-", dir="/tmp"))
    try:
        names = syscall_names(seccomp_helper(helper_dir))
    finally:
        shutil.rmtree(helper_dir, ignore_errors=True)
        _helper_cache.clear()
    extra: list[str] = []
    last = run_cycle(caps, profile=profile, criu_opts=criu_opts)
    for _ in range(rounds):
        if last.ok:
            break
        probe = run_cycle(caps, profile=profile, extra_allow=extra, discover=True, criu_opts=criu_opts)
        found = [names[n - ERRNO_BASE] for n in probe.errnos
                 if n - ERRNO_BASE in names and names[n - ERRNO_BASE] not in extra]
        log(f"    {short(caps)} +allow {','.join(extra) or '-'}: {last.stage}: {last.error}; "
            f"numbered errnos name {','.join(found) or 'nothing'}")
        if not found:
            break
        extra += found
        last = run_cycle(caps, profile=profile, extra_allow=extra, criu_opts=criu_opts)
    if last.ok:  # minimise: which of them are really needed
        for name in list(extra):
            if run_cycle(caps, profile=profile, extra_allow=[n for n in extra if n != name], criu_opts=criu_opts).ok:
                extra.remove(name)
        last = run_cycle(caps, profile=profile, extra_allow=extra, criu_opts=criu_opts)
    return extra, last


def row(label: str, c: Cycle) -> dict[str, object]:
    return {"label": label, "caps": short(c.caps), "criu_opts": c.criu_opts, "seccomp": c.seccomp or "unconfined",
            "extra_allow": c.extra_allow, "no_new_privs": c.no_new_privs, "ro_proc_sys": c.ro_proc_sys,
            "ok": c.ok, "stage": c.stage, "error": c.error, "ns_last_pid": c.ns_last_pid,
            "seen_caps": c.seen_caps, "seconds": c.seconds}


def print_table(rows: list[dict[str, object]]) -> None:
    w = max(len(str(r["label"])) for r in rows)
    print(f"\n{'set':<{w}}  result  {'failed at':<11}  error")
    print(f"{'-' * w}  ------  {'-' * 11}  -----")
    for r in rows:
        print(f"{r['label']:<{w}}  {'PASS' if r['ok'] else 'FAIL':<6}  {r['stage'] or '-':<11}  {r['error'] or '-'}")


def criu_version(criu: str) -> str:
    done = subprocess.run([criu, "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"Version:\s*(\S+)", done.stdout)
    return m.group(1) if m else done.stdout.strip()


# How CRIU is run: its options, and whether the container has no_new_privs set (Kubernetes:
# allowPrivilegeEscalation: false). "plain" is criu as cairn runs it (cairn/process/criu.py).
CONFIGS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("plain", (), False),
    ("plain+nnp", (), True),
    ("unprivileged", ("--unprivileged",), False),
    ("unprivileged+nnp", ("--unprivileged",), True),
)


def measure(*, quick: bool, log=print) -> dict[str, object]:  # noqa: ANN001
    tools = require_tools(seccomp=True)
    full = host_capabilities()
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    env = {"kernel": platform.release(), "criu": criu_version(tools["criu"]),
           "host_caps": len(full), "host_lacks": [c for c in CAP_NAMES if c not in full],
           "yama_ptrace_scope": yama.read_text().strip() if yama.exists() else None}
    log(f"kernel {env['kernel']}, criu {env['criu']}; this host grants {len(full)} capabilities"
        + (f" (not {', '.join(env['host_lacks'])})" if env["host_lacks"] else "")
        + f"; Yama ptrace_scope {env['yama_ptrace_scope'] or 'absent'}")
    rows: list[dict[str, object]] = []
    report: dict[str, object] = {"env": env, "configs": {}}

    for config, opts, nnp in CONFIGS:
        tag = f"[{config}]"

        def cycle(caps: Iterable[str], **kw: object) -> Cycle:
            return run_cycle(caps, criu_opts=opts, no_new_privs=nnp, **kw)  # type: ignore[arg-type]

        base = cycle(full)
        rows.append(row(f"{tag} all the host grants", base))
        if not base.ok:
            log(f"{tag} the cycle fails even with every capability: {base.error}")
            report["configs"][config] = {"error": base.error}
            continue
        out: dict[str, object] = {"criu_opts": list(opts), "no_new_privs": nnp}
        if quick:
            minimal = list(MEASURED_MINIMAL[config])
        else:
            log(f"{tag} greedy minimisation (drop each capability in number order):")
            minimal = list(full)
            greedy = []
            for cap in full:
                trial = cycle([c for c in minimal if c != cap])
                greedy.append({"dropped": cap, "ok": trial.ok, "stage": trial.stage, "error": trial.error})
                log(f"  without {cap:<24} {'pass -> dropped' if trial.ok else 'FAIL -> kept: ' + trial.error}")
                if trial.ok:
                    minimal.remove(cap)
            out["greedy"] = greedy
        out["minimal"] = minimal
        out["minimal_matches_recorded"] = (sorted(minimal, key=cap_number)
                                           == sorted(MEASURED_MINIMAL[config], key=cap_number))
        rows.append(row(f"{tag} minimal: {short(minimal)}", cycle(minimal)))
        without = {}
        for cap in minimal:
            c = cycle([x for x in minimal if x != cap])
            without[cap] = {"ok": c.ok, "stage": c.stage, "error": c.error, "ns_last_pid": c.ns_last_pid}
            rows.append(row(f"{tag} minimal without {cap.removeprefix('CAP_')}", c))
        out["without_each"] = without
        for label, caps in CANDIDATES:
            rows.append(row(f"{tag} {label}", cycle(caps)))
        rows.append(row(f"{tag} minimal, /proc/sys read-only", cycle(minimal, ro_proc_sys=True)))

        if not nnp:
            log(f"{tag} seccomp (scripts/seccomp/default-like.json):")
            blocking = {}
            for label, caps in ((f"minimal: {short(minimal)}", minimal),
                                ("docker default+SYS_PTRACE+CHECKPOINT_RESTORE", DOCKER_PTRACE_CR),
                                ("all the host grants", full)):
                c = cycle(caps, profile=DEFAULT_PROFILE)
                rows.append(row(f"{tag} {label} + default-like seccomp", c))
                if c.ok:
                    blocking[label] = {"ok": True}
                    continue
                extra, last = find_blocking_syscalls(caps, DEFAULT_PROFILE, opts, log=log)
                blocking[label] = {"ok": False, "stage": c.stage, "error": c.error, "allowing": extra,
                                   "then_ok": last.ok, "then_stage": last.stage, "then_error": last.error}
                if extra:
                    rows.append(row(f"{tag} {label} + default-like + allow {','.join(extra)}", last))
            # A filter that denies nothing: does the mere presence of a filter stop CRIU?
            c = cycle(full, profile=ALLOW_ALL_PROFILE)
            rows.append(row(f"{tag} all the host grants + allow-all seccomp filter", c))
            blocking["allow-all filter, all the host grants"] = {"ok": c.ok, "stage": c.stage, "error": c.error}
            out["seccomp"] = blocking
        report["configs"][config] = out
    report["rows"] = rows
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the greedy search; check MEASURED_MINIMAL")
    ap.add_argument("--cycle", metavar="CAPS", help="run one cycle with these capabilities (comma-separated; '' = none)")
    ap.add_argument("--seccomp", metavar="PROFILE", type=Path, help="with --cycle: under this seccomp profile")
    ap.add_argument("--allow", default="", help="with --seccomp: also allow these syscalls (comma-separated)")
    ap.add_argument("--no-new-privs", action="store_true", help="with --cycle: set no_new_privs")
    ap.add_argument("--ro-proc-sys", action="store_true", help="with --cycle: mount /proc/sys read-only")
    ap.add_argument("--keep", action="store_true", help="with --cycle: keep the work directory (images, logs)")
    ap.add_argument("--inner", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--criu", help=argparse.SUPPRESS)
    ap.add_argument("--criu-opt", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--unprivileged", action="store_true", help="with --cycle: pass --unprivileged to criu")
    args = ap.parse_args(argv)
    if args.inner:
        return inner(args.inner, args.criu, args.criu_opt)
    if args.cycle is not None:
        caps = [c.strip().upper() for c in args.cycle.split(",") if c.strip()]
        caps = [c if c.startswith("CAP_") else f"CAP_{c}" for c in caps]
        c = run_cycle(caps, profile=args.seccomp.resolve() if args.seccomp else None,
                      extra_allow=[s for s in args.allow.split(",") if s], no_new_privs=args.no_new_privs,
                      ro_proc_sys=args.ro_proc_sys, keep=args.keep,
                      criu_opts=["--unprivileged"] if args.unprivileged else [])
        print_table([row(short(caps), c)])
        print(json.dumps(asdict(c)))
        return 0 if c.ok else 1
    report = measure(quick=args.quick)
    print_table(report["rows"])  # type: ignore[arg-type]
    print()
    for config, out in report["configs"].items():  # type: ignore[union-attr]
        if "minimal" in out:
            print(f"minimal set [{config}]: {short(out['minimal'])}"
                  + ("" if out["minimal_matches_recorded"] else "  (differs from MEASURED_MINIMAL!)"))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
