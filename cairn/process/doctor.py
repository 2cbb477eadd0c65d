"""``cairn doctor``: can this host checkpoint a training process with CRIU, and at what cost?

Each item is one :class:`Check`. By default nothing is FAIL: the report describes the host
and warns about what process mode would lack. With ``preflight=True`` whatever process mode
cannot do without is FAIL, so :attr:`DoctorReport.ok` can gate a job.

Every parser is a pure function of text (``/proc`` files, command output) so tests can feed
fixtures; :func:`run_doctor` only gathers that text from the real host.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from cairn.exceptions import ConfigError
from cairn.runtime.env import CRIU as CRIU_VAR
from cairn.process import criu as criu_mod
from cairn.process.background import Background
from cairn.process import gpu_budget
from cairn.process import gpus as gpus_mod

Reader = Callable[[str], "str | None"]
"""Returns a file's text, or ``None`` when it is missing or unreadable."""

# The assumed device-to-host rate of the checkpoint copy (cairn.process.gpu_budget). Frozen-time
# figures derived from it are estimates only and exclude writing the image to disk.
ASSUMED_D2H_BYTES_PER_S = gpu_budget.DEFAULT_D2H_BYTES_PER_S

MIN_KERNEL = (5, 9)  # CAP_CHECKPOINT_RESTORE; clone3 with set_tid arrived in 5.5
_UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as a page-rounded 2**63-1


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    """One diagnosed item. ``fix`` says what to change; empty when nothing needs changing."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail, "fix": self.fix}


@dataclass(frozen=True)
class DoctorReport:
    checks: tuple[Check, ...]
    preflight: bool

    @property
    def ok(self) -> bool:
        """True when no check FAILed (WARNs do not count)."""
        return all(c.status is not Status.FAIL for c in self.checks)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "preflight": self.preflight,
                           "checks": [c.to_dict() for c in self.checks]}, indent=2)

    def format_text(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        lines = []
        for c in self.checks:
            lines.append(f"[{c.status.value.upper():4}] {c.name:<{width}}  {c.detail}")
            if c.fix and c.status is not Status.OK:
                lines.append(f"       {'':<{width}}  fix: {c.fix}")
        mode = "preflight for process mode" if self.preflight else "host report"
        verdict = "ok" if self.ok else "NOT ok: process mode cannot run here"
        lines.append(f"{mode}: {verdict}")
        return "\n".join(lines)


# -- parsing (pure) ---------------------------------------------------------------------------

CAPABILITY_NAMES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
    "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN",
    "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON",
    "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)  # index = capability number (linux/capability.h)

# Capabilities CRIU uses beyond the required ones (see criu(8) NON-ROOT); their lack limits what
# can be checkpointed (sockets, rlimits, credentials) rather than ruling process mode out.
USEFUL_CAPABILITIES: tuple[str, ...] = (
    "CAP_NET_ADMIN", "CAP_SYS_RESOURCE", "CAP_KILL", "CAP_SETPCAP", "CAP_SETUID", "CAP_SETGID",
    "CAP_SYS_CHROOT", "CAP_DAC_OVERRIDE",
)


def status_field(status_text: str, field: str) -> str | None:
    """The value of ``Field:`` in ``/proc/<pid>/status`` text, or ``None`` if absent."""
    m = re.search(rf"^{re.escape(field)}:\s*(.*?)\s*$", status_text, re.MULTILINE)
    return m.group(1) if m else None


def decode_capabilities(mask: int | str) -> frozenset[str]:
    """Capability names set in ``mask`` (an int or the hex of ``CapEff``); unknown bits as CAP_<n>."""
    value = int(mask, 16) if isinstance(mask, str) else mask
    if value < 0:
        raise ValueError(f"negative capability mask {mask!r}")
    names = set()
    bit = 0
    while value >> bit:
        if value >> bit & 1:
            names.add(CAPABILITY_NAMES[bit] if bit < len(CAPABILITY_NAMES) else f"CAP_{bit}")
        bit += 1
    return frozenset(names)


def effective_capabilities(status_text: str) -> frozenset[str] | None:
    """Decoded ``CapEff`` of ``/proc/<pid>/status`` text; ``None`` if the field is missing."""
    raw = status_field(status_text, "CapEff")
    return None if raw is None else decode_capabilities(raw)


class SeccompMode(enum.Enum):
    DISABLED = 0
    STRICT = 1
    FILTER = 2


def parse_seccomp(status_text: str) -> SeccompMode | None:
    """``Seccomp:`` of ``/proc/<pid>/status`` text; ``None`` on kernels built without seccomp."""
    raw = status_field(status_text, "Seccomp")
    try:
        return None if raw is None else SeccompMode(int(raw))
    except ValueError:
        return None


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per field (``kB`` values scaled; unitless ones as given)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+):\s+(\d+)(?:\s+(kB))?\s*$", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def parse_kernel_release(text: str) -> tuple[int, ...] | None:
    """``6.18.44-fc-v782`` → ``(6, 18, 44)``; ``None`` if it does not start with a version."""
    m = re.match(r"^\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_used_bytes: int | None  # None when the inventory could not tell
    memory_total_bytes: int | None


def parse_nvidia_driver_version(text: str) -> str | None:
    """The version in ``/proc/driver/nvidia/version`` ("NVRM version: ... Kernel Module  550.54.15 ...")."""
    m = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return m.group(1) if m else None


class CgroupVersion(str, enum.Enum):
    V1 = "v1"
    V2 = "v2"
    HYBRID = "hybrid"  # v1 controllers plus an empty v2 hierarchy (e.g. at /sys/fs/cgroup/unified)
    NONE = "none"


def parse_cgroup_version(mounts_text: str) -> CgroupVersion:
    """The cgroup layout from ``/proc/self/mounts`` text."""
    v1 = v2 = v2_at_root = False
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        if fields[2] == "cgroup2":
            v2 = True
            v2_at_root = v2_at_root or fields[1] == "/sys/fs/cgroup"
        elif fields[2] == "cgroup":
            v1 = True
    if v2_at_root or (v2 and not v1):
        return CgroupVersion.V2
    if v1:
        return CgroupVersion.HYBRID if v2 else CgroupVersion.V1
    return CgroupVersion.NONE


@dataclass(frozen=True)
class CgroupMemory:
    """This process's memory cgroup: its limit and the working set charged against it."""

    limit_bytes: int | None  # None: unlimited
    working_set_bytes: int

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.limit_bytes is None else max(0, self.limit_bytes - self.working_set_bytes)


def memory_cgroup_files(proc_cgroup_text: str, version: CgroupVersion) -> tuple[str, str, str] | None:
    """Paths of (limit, usage, stat) for this process's memory cgroup, from ``/proc/self/cgroup``."""
    for line in proc_cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        path = path.rstrip("/")
        if version is CgroupVersion.V2 and hid == "0":
            base = f"/sys/fs/cgroup{path}"
            return f"{base}/memory.max", f"{base}/memory.current", f"{base}/memory.stat"
        if version in (CgroupVersion.V1, CgroupVersion.HYBRID) and "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            return (f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes",
                    f"{base}/memory.stat")
    return None


def parse_cgroup_memory(limit_text: str, usage_text: str, stat_text: str) -> CgroupMemory:
    """Limit and working set (usage less inactive page cache, as the kubelet counts it)."""
    raw = limit_text.strip()
    limit = None if raw == "max" or int(raw) >= _UNLIMITED else int(raw)
    stat = dict(line.split()[:2] for line in stat_text.splitlines() if len(line.split()) >= 2)
    inactive = int(stat.get("total_inactive_file", stat.get("inactive_file", "0")))
    usage = int(usage_text.strip())
    return CgroupMemory(limit, max(0, usage - inactive))


def estimate_frozen_seconds(gpu_bytes: int) -> float:
    """Seconds to copy ``gpu_bytes`` device-to-host at :data:`ASSUMED_D2H_BYTES_PER_S` (an estimate)."""
    return gpu_bytes / ASSUMED_D2H_BYTES_PER_S


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# -- checks (pure: they take what was read) ---------------------------------------------------

def _lacking(preflight: bool) -> Status:
    """What a missing necessity of process mode is: FAIL in a preflight, else a warning."""
    return Status.FAIL if preflight else Status.WARN


_CRIU_FIX = "run `sudo bash scripts/build_criu.sh` (builds CRIU 4.1.1) or set " + CRIU_VAR.name + " to a criu >= 4"


def check_criu_binary(path: str | None, version: tuple[int, ...] | None, *, preflight: bool,
                      error: str = "") -> Check:
    if error:
        return Check("criu", _lacking(preflight), error, _CRIU_FIX)
    if path is None:
        return Check("criu", _lacking(preflight), f"no criu binary ({CRIU_VAR}, PATH, /usr/local/sbin)",
                     _CRIU_FIX)
    if version is None:
        return Check("criu", _lacking(preflight), f"{path}: cannot read its version", _CRIU_FIX)
    shown = criu_mod.format_version(version)
    if version < criu_mod.MIN_VERSION:
        return Check("criu", _lacking(preflight),
                     f"{path} is {shown}; process mode needs >= {criu_mod.format_version(criu_mod.MIN_VERSION)}",
                     _CRIU_FIX)
    return Check("criu", Status.OK, f"{path} {shown}")


def check_criu_kernel(path: str | None, result: criu_mod.CriuCheck | None, *, preflight: bool) -> Check:
    if path is None or result is None:
        return Check("criu check", _lacking(preflight), "not run: no usable criu", _CRIU_FIX)
    if result.ok:
        return Check("criu check", Status.OK, "Looks good")
    tail = " | ".join(result.output.splitlines()[-5:]) or "no output"
    return Check("criu check", _lacking(preflight), f"failed: {tail}",
                 "run the job as root with the capabilities of ADR 0008 (SYS_ADMIN, SYS_TIME, "
                 "NET_ADMIN, SYS_PTRACE added to the runtime's defaults) and seccomp Unconfined, on "
                 "a kernel with CONFIG_CHECKPOINT_RESTORE; see `criu check --all`")


def check_kernel(osrelease: str | None, *, preflight: bool) -> Check:
    if osrelease is None:
        return Check("kernel", Status.WARN, "cannot read /proc/sys/kernel/osrelease")
    release = osrelease.strip()
    version = parse_kernel_release(release)
    if version is None:
        return Check("kernel", Status.WARN, f"{release}: cannot parse the version")
    if version < MIN_KERNEL:
        return Check("kernel", _lacking(preflight),
                     f"{release} is older than {'.'.join(map(str, MIN_KERNEL))} "
                     "(no CAP_CHECKPOINT_RESTORE; restoring PIDs is racy)",
                     "use a node image with kernel >= 5.9")
    return Check("kernel", Status.OK, release)


# Measured on kernel 6.18 with CRIU 4.1.1 run as cairn runs it (ADR 0008): each of these is
# needed by dump or restore; SETPCAP only without no_new_privs.
REQUIRED_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SYS_TIME", "CAP_NET_ADMIN", "CAP_SYS_CHROOT",
                         "CAP_SETPCAP")
CAPABILITY_FIX = ("add securityContext.capabilities.add: [SYS_ADMIN, SYS_TIME, NET_ADMIN, "
                  "SYS_PTRACE] (SETPCAP and SYS_CHROOT are in the runtime's defaults), or run "
                  "privileged; see docs/adr/0008-process-mode-privileges.md")


def check_capabilities(status_text: str | None, *, preflight: bool, ptrace_scope: str | None = None) -> Check:
    """CRIU as cairn runs it needs :data:`REQUIRED_CAPABILITIES`, and CAP_SYS_PTRACE unless
    Yama's ptrace_scope is 0 (CRIU is the workload's sibling, not its ancestor)."""
    caps = effective_capabilities(status_text) if status_text is not None else None
    if caps is None:
        return Check("capabilities", Status.WARN, "cannot read CapEff from /proc/self/status")
    missing = [c for c in REQUIRED_CAPABILITIES if c not in caps]
    if "CAP_SYS_PTRACE" not in caps and (ptrace_scope or "0").strip() != "0":
        missing.append("CAP_SYS_PTRACE")
    useful_missing = [c for c in USEFUL_CAPABILITIES if c not in caps and c not in missing]
    key = REQUIRED_CAPABILITIES + ("CAP_SYS_PTRACE", "CAP_CHECKPOINT_RESTORE") + USEFUL_CAPABILITIES
    present = [c for c in dict.fromkeys(key) if c in caps]
    detail = f"{len(caps)} effective; present: {', '.join(present) or 'none of those CRIU uses'}"
    if missing:
        return Check("capabilities", _lacking(preflight),
                     f"{detail}; missing required: {', '.join(missing)}", CAPABILITY_FIX)
    if useful_missing:
        return Check("capabilities", Status.WARN,
                     f"{detail}; missing (limits what can be checkpointed): {', '.join(useful_missing)}",
                     f"add securityContext.capabilities.add: "
                     f"[{', '.join(c.removeprefix('CAP_') for c in useful_missing)}]")
    return Check("capabilities", Status.OK, detail)


_SECCOMP_FIX = "set securityContext.seccompProfile: {type: Unconfined} on the pod/container"


def check_seccomp(status_text: str | None, *, preflight: bool) -> Check:
    mode = parse_seccomp(status_text) if status_text is not None else None
    if mode is None:
        return Check("seccomp", Status.OK, "not reported (kernel without seccomp)")
    if mode is SeccompMode.DISABLED:
        return Check("seccomp", Status.OK, "disabled")
    filters = status_field(status_text or "", "Seccomp_filters")
    more = f" ({filters} filters)" if filters else ""
    return Check("seccomp", _lacking(preflight),
                 f"mode {mode.value} ({mode.name.lower()}){more}: CRIU cannot suspend the "
                 "workload's filters from under a filter of its own, whatever it allows "
                 "(measured, ADR 0008)", _SECCOMP_FIX)


def check_ns_last_pid(error: str | None, caps: frozenset[str] | None, *, preflight: bool) -> Check:
    """Can restore set the next PID? ``error``: why opening ``/proc/sys/kernel/ns_last_pid`` for
    writing failed, or ``None``; ``caps``: the effective capabilities, if known.

    The file is mode 0666, so opening it proves little; the kernel allows the write only with
    CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN. Both are checked and nothing is written, because
    writing would move the PID counter of every process on the host.
    """
    fix = ("mount /proc/sys read-write (privileged pod, or procMount: Unmasked) and grant "
           "CAP_CHECKPOINT_RESTORE")
    if error is not None:
        return Check("ns_last_pid", _lacking(preflight),
                     f"/proc/sys/kernel/ns_last_pid does not open for writing: {error}; "
                     "restore cannot choose PIDs", fix)
    if caps is not None and not caps & {"CAP_CHECKPOINT_RESTORE", "CAP_SYS_ADMIN"}:
        return Check("ns_last_pid", _lacking(preflight),
                     "opens for writing, but a write needs CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN",
                     fix)
    how = "" if caps is not None else "; capabilities unknown"
    return Check("ns_last_pid", Status.OK, f"writable (opened for writing, nothing written{how})")


def check_cgroup(mounts_text: str | None) -> Check:
    if mounts_text is None:
        return Check("cgroup", Status.WARN, "cannot read /proc/self/mounts")
    version = parse_cgroup_version(mounts_text)
    if version is CgroupVersion.NONE:
        return Check("cgroup", Status.WARN, "no cgroup filesystem mounted")
    return Check("cgroup", Status.OK, version.value)


def check_nvidia(inv: gpus_mod.Inventory, driver_text: str | None, *, preflight: bool,
                 mps: bool = False) -> tuple[Check, tuple[Gpu, ...]]:
    """The driver and GPUs from the inventory (NVML, else nvidia-smi); ``driver_text``:
    ``/proc/driver/nvidia/version``, if readable; ``mps``: an MPS control pipe is set up
    (NVML's MPS clients, in the inventory, count too).

    Process snapshots of a GPU workload need driver >= 570, a restore onto another GPU
    >= 580; MIG and MPS are refused (the driver cannot checkpoint their clients)."""
    loaded = parse_nvidia_driver_version(driver_text) if driver_text else None
    if inv.source is gpus_mod.Source.NONE:
        if loaded is None:
            return Check("nvidia", Status.OK, "no NVIDIA GPU"), ()
        return (Check("nvidia", Status.WARN, f"driver {loaded} loaded but no GPU inventory: "
                      f"{inv.note}", "install cairn-resume[gpu] (pynvml) or nvidia-smi in the "
                      "image, and check that the GPUs are visible to this container"), ())
    shown = tuple(Gpu(d.name, d.memory_used, d.memory_total) for d in inv.devices)
    driver = inv.driver or loaded or "unknown"
    via = "NVML" if inv.source is gpus_mod.Source.NVML else f"nvidia-smi ({inv.note})"
    listing = "; ".join(f"{d.name} {human_bytes(d.memory_used)} / {human_bytes(d.memory_total)}"
                        f" used" + (" MIG" if d.mig else "") for d in inv.devices)
    detail = f"driver {driver}; {len(inv.devices)} GPU(s) via {via}: {listing or 'none visible'}"
    major = inv.driver_major
    if inv.devices and (major is None or major < gpus_mod.MIN_DRIVER):
        return (Check("nvidia", _lacking(preflight), f"{detail}; GPU process snapshots need "
                      f"driver >= {gpus_mod.MIN_DRIVER}",
                      f"use a node image with NVIDIA driver >= {gpus_mod.REMAP_DRIVER}, or "
                      "state mode (cairn.Checkpointer)"), shown)
    refused = [f"MIG is enabled on GPU {d.index}" for d in inv.devices if d.mig]
    if mps:
        refused.append("MPS is in use (a control pipe is set up)")
    refused += [f"MPS is in use on GPU {d.index} ({len(inv.mps_clients[d.uuid])} client(s), "
                "NVML)" for d in inv.devices if inv.mps_clients.get(d.uuid)]
    if refused:
        return (Check("nvidia", _lacking(preflight), f"{detail}; {'; '.join(refused)}: the "
                      "driver cannot checkpoint MIG or MPS clients",
                      "run on whole GPUs without MIG or MPS, or use state mode "
                      "(cairn.Checkpointer)"), shown)
    if inv.devices and not inv.can_remap:
        return (Check("nvidia", Status.WARN, f"{detail}; process snapshots: yes; restore onto "
                      f"another GPU: no (needs driver >= {gpus_mod.REMAP_DRIVER}), so a retry "
                      "on another node starts fresh",
                      f"use a node image with NVIDIA driver >= {gpus_mod.REMAP_DRIVER}"), shown)
    if inv.devices:
        detail += "; process snapshots: yes; restore onto another GPU: yes"
    return Check("nvidia", Status.OK, detail), shown


def mps_in_use(environ: Mapping[str, str] | None = None) -> bool:
    """An MPS control daemon's pipe directory exists (``CUDA_MPS_PIPE_DIRECTORY``, default
    ``/tmp/nvidia-mps``): CUDA clients here would connect to it."""
    pipes = (os.environ if environ is None else environ).get("CUDA_MPS_PIPE_DIRECTORY",
                                                             "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


def check_memory(meminfo_text: str | None, gpus: Iterable[Gpu], *, preflight: bool,
                 cgroup: CgroupMemory | None = None) -> Check:
    """Host RAM available against GPU memory in use (it is staged in host RAM while frozen)."""
    info = parse_meminfo(meminfo_text) if meminfo_text is not None else {}
    if "MemAvailable" not in info:
        return Check("memory", Status.WARN, "cannot read MemAvailable from /proc/meminfo")
    available = info["MemAvailable"]
    where = "MemAvailable"
    if cgroup is not None and cgroup.headroom_bytes is not None and cgroup.headroom_bytes < available:
        available, where = cgroup.headroom_bytes, "cgroup limit headroom"
    gpu_used = sum(g.memory_used_bytes or 0 for g in gpus)
    detail = f"{human_bytes(available)} available ({where})"
    if gpu_used == 0:
        return Check("memory", Status.OK, f"{detail}; no GPU memory in use")
    seconds = estimate_frozen_seconds(gpu_used)
    detail += (f"; {human_bytes(gpu_used)} GPU memory in use, est. {seconds:.1f}s frozen to copy it "
               f"at an assumed {ASSUMED_D2H_BYTES_PER_S / 1e9:.0f} GB/s device-to-host")
    if available < gpu_used:
        return Check("memory", _lacking(preflight),
                     f"{detail}; host RAM is short by {human_bytes(gpu_used - available)}",
                     f"request at least {human_bytes(gpu_used - available)} more memory for the "
                     "pod, or use state mode (cairn.state) instead")
    return Check("memory", Status.OK, detail)


# -- gathering from the real host --------------------------------------------------------------

def read_text(path: str) -> str | None:
    """The default :data:`Reader`: the file's text, or ``None`` if it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def probe_writable(path: str) -> str | None:
    """``None`` if ``path`` opens for writing, else why not. Opens only: nothing is written."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        return f"{errno.errorcode.get(e.errno or 0, 'error')} ({e.strerror})"
    os.close(fd)
    return None


def cgroup_memory(read: Reader = read_text) -> CgroupMemory | None:
    """This process's memory cgroup (v1 or v2), read through ``read``; None when there is
    none to read (no cgroup filesystem, or the root cgroup, which has no limit file)."""
    mounts = read("/proc/self/mounts")
    if mounts is None:
        return None
    version = parse_cgroup_version(mounts)
    proc_cgroup = read("/proc/self/cgroup")
    files = memory_cgroup_files(proc_cgroup, version) if proc_cgroup else None
    if files is None:
        return None
    texts = [read(p) for p in files]
    if any(t is None for t in texts):
        return None  # e.g. the root cgroup, which has no limit file
    try:
        return parse_cgroup_memory(*texts)  # type: ignore[arg-type]
    except ValueError:
        return None


def run_doctor(*, preflight: bool = False, read: Reader = read_text,
               env: Mapping[str, str] | None = None) -> DoctorReport:
    """Diagnose this host for process mode (see the module docstring for ``preflight``)."""
    checks: list[Check] = []

    error = ""
    try:
        criu_path = criu_mod.find_criu(env)
    except ConfigError as e:
        criu_path, error = None, str(e)
    version = criu_mod.criu_version(criu_path) if criu_path else None
    binary = check_criu_binary(criu_path, version, preflight=preflight, error=error)
    checks.append(binary)
    usable = criu_path if binary.status is Status.OK else None
    checks.append(check_criu_kernel(usable, criu_mod.criu_check(usable) if usable else None,
                                    preflight=preflight))

    checks.append(check_kernel(read("/proc/sys/kernel/osrelease"), preflight=preflight))
    status_text = read("/proc/self/status")
    checks.append(check_capabilities(status_text, preflight=preflight,
                                     ptrace_scope=read("/proc/sys/kernel/yama/ptrace_scope")))
    checks.append(check_seccomp(status_text, preflight=preflight))
    caps = effective_capabilities(status_text) if status_text is not None else None
    checks.append(check_ns_last_pid(probe_writable("/proc/sys/kernel/ns_last_pid"), caps,
                                    preflight=preflight))

    mounts = read("/proc/self/mounts")
    checks.append(check_cgroup(mounts))

    nvidia, gpus = check_nvidia(gpus_mod.inventory(environ=env),
                                read("/proc/driver/nvidia/version"), preflight=preflight,
                                mps=mps_in_use(env))
    checks.append(nvidia)

    cgroup = cgroup_memory(read)
    checks.append(check_memory(read("/proc/meminfo"), gpus, preflight=preflight, cgroup=cgroup))
    return DoctorReport(tuple(checks), preflight)


class Preflight(Background[DoctorReport]):
    """:func:`run_doctor` with ``preflight=True`` on a daemon thread of its own. ``cairn run``
    starts it once ``/proc/sys`` is writable (a mount namespace unshared before any thread
    starts) and opens the store and parses its snapshots meanwhile, so that ``criu check`` (a
    subprocess: 0.05-0.2 s here) no longer adds to the time before a restore begins.
    :meth:`report` waits for it, and raises what the checks raised."""

    def __init__(self) -> None:
        super().__init__(lambda: run_doctor(preflight=True), name="cairn-preflight")

    def report(self) -> DoctorReport:
        return self.result()
