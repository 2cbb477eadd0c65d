"""Locate the CRIU binary, read its version and run ``criu check``.

Search order for the binary: ``$CAIRN_CRIU`` (must then exist), ``criu`` on ``PATH``, then
``/usr/local/sbin/criu`` (where ``scripts/build_criu.sh`` installs it; often not on a
non-root ``PATH``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cairn.exceptions import ConfigError, CriuFailed
from cairn.process.background import Background
from cairn.runtime.env import CRIU as CRIU_VAR

ENV_VAR = CRIU_VAR.name
DEFAULT_PATH = "/usr/local/sbin/criu"
MIN_VERSION: tuple[int, ...] = (4,)  # 4.0 brought the CUDA plugin that GPU processes need
CHECK_TIMEOUT_S = 60.0

_VERSION_RE = re.compile(r"^Version:\s*(\d+(?:\.\d+)*)", re.MULTILINE)


@dataclass(frozen=True)
class CriuCheck:
    """The outcome of ``criu check``: ``ok`` only when it exits 0 and says "Looks good"."""

    ok: bool
    output: str


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_criu(
    env: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> str | None:
    """The CRIU binary to use, or ``None`` when there is none.

    Raises :class:`ConfigError` when ``$CAIRN_CRIU`` is set but is not an executable file:
    silently using another binary would hide the typo.
    """
    env = os.environ if env is None else env
    given = env.get(ENV_VAR, "").strip()
    if given:
        if not _is_executable(given):
            raise ConfigError(f"{ENV_VAR}={given} is not an executable file; "
                              f"point it at a criu binary or unset it")
        return given
    on_path = which("criu")
    if on_path:
        return on_path
    return DEFAULT_PATH if _is_executable(DEFAULT_PATH) else None


def parse_version(text: str) -> tuple[int, ...] | None:
    """``criu --version`` output ("Version: 4.1.1" …) to ``(4, 1, 1)``; ``None`` if absent."""
    m = _VERSION_RE.search(text)
    return tuple(int(part) for part in m.group(1).split(".")) if m else None


def format_version(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


# Versions asked, by the binary's path and file identity: ``cairn run`` needs it for the host
# checks and again for the snapshot's compatibility record, and each ask is a subprocess.
_VERSIONS: dict[tuple[str, int, int, int, int], tuple[int, ...] | None] = {}


def criu_version(binary: str) -> tuple[int, ...] | None:
    """The version ``binary --version`` reports, or ``None`` if it cannot run or says none.
    Asked once per binary file (a file replaced at that path is asked again); any thread."""
    try:
        st = os.stat(binary)
    except OSError:
        return None
    identity = (binary, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in _VERSIONS:
        return _VERSIONS[identity]
    try:
        done = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=CHECK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = _VERSIONS[identity] = parse_version(done.stdout + done.stderr)
    return version


def criu_check(binary: str, *, unprivileged: bool | None = None) -> CriuCheck:
    """Run ``criu check`` (kernel and permission features CRIU needs) and keep its output.

    ``unprivileged`` defaults to "not root": CRIU refuses to run as non-root without
    ``--unprivileged``, and that refusal is not what the caller wants to learn about.
    """
    if unprivileged is None:
        unprivileged = os.geteuid() != 0
    argv = [binary, "check"] + (["--unprivileged"] if unprivileged else [])
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=CHECK_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        return CriuCheck(False, f"{' '.join(argv)} did not finish within {CHECK_TIMEOUT_S:.0f}s")
    except OSError as e:
        return CriuCheck(False, f"cannot run {binary}: {e}")
    output = done.stdout.strip()
    return CriuCheck(done.returncode == 0 and "Looks good" in output, output)


def has_feature(binary: str, feature: str) -> bool:
    """Whether ``criu check --feature FEATURE`` passes here (``uffd-noncoop``: what a lazy
    restore needs)."""
    try:
        done = subprocess.run([binary, "check", "--feature", feature], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def probe_feature(binary: str, feature: str) -> Callable[[], bool]:
    """Start :func:`has_feature` on a thread of its own; the returned callable waits for the
    answer. ``cairn run --restore lazy`` asks for ``uffd-noncoop`` while it opens the store,
    not after (a ``criu check`` takes 0.05-0.2 s here)."""
    return Background(lambda: has_feature(binary, feature), name=f"cairn-criu-{feature}").result


DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
# Unlinked files the workload holds open (torch's DataLoader shares batches through deleted
# /dev/shm files) are saved whole into the image up to this size; CRIU's default of 1 MiB
# refuses ordinary batches.
DEFAULT_GHOST_LIMIT = 512 << 20


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return "(no CRIU log)"
    errors = [line for line in text if "Error" in line or "error" in line]
    return "\n".join((errors or text)[-lines:])


def set_parent_death_kill() -> None:
    # A dump must not outlive the supervisor that would ingest it (and CRIU holding the
    # workload frozen under ptrace should let go when the supervisor is killed).
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _run(binary: str, argv: list[str], log_path: str, what: str, timeout: float | None,
         *, die_with_parent: bool = False) -> None:
    try:
        done = subprocess.run([binary, *argv], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout, check=False,
                              preexec_fn=set_parent_death_kill if die_with_parent else None)
    except FileNotFoundError:
        raise CriuFailed(f"criu {what}: {binary} does not exist (run `make criu`, or set "
                         f"{ENV_VAR})") from None
    except PermissionError:
        raise CriuFailed(f"criu {what}: {binary} is not executable") from None
    except subprocess.TimeoutExpired:
        raise CriuFailed(f"criu {what} did not finish within {timeout:.0f}s (killed):\n"
                         f"{log_tail(log_path)}") from None
    if done.returncode != 0:
        raise CriuFailed(f"criu {what} failed (exit {done.returncode}):\n"
                         f"{(done.stdout + done.stderr).strip()}\n{log_tail(log_path)}")


def dump(binary: str, pid: int, image_dir: str, *, leave_running: bool,
         ghost_limit: int = DEFAULT_GHOST_LIMIT, timeout: float | None = None,
         extra: list[str] | None = None) -> None:
    """``criu dump`` of the tree rooted at ``pid`` into ``image_dir`` (which must exist).

    With ``leave_running`` the tree is thawed after the dump; otherwise CRIU kills it once
    the images are written. On failure CRIU resumes the tree and :class:`CriuFailed` is raised.
    """
    argv = ["dump", "-t", str(pid), "-D", image_dir, "-o", DUMP_LOG,
            "--manage-cgroups=ignore", "--ghost-limit", str(ghost_limit)]
    if leave_running:
        argv.append("--leave-running")
    _run(binary, argv + list(extra or ()), os.path.join(image_dir, DUMP_LOG), "dump", timeout,
         die_with_parent=True)


def restore(binary: str, image_dir: str, *, pidfile: str, timeout: float | None = None,
            extra: list[str] | None = None) -> int:
    """``criu restore`` from ``image_dir``, detached, with the restored root a *sibling* of
    CRIU: a child of the caller, so the caller can wait for it and the root's parent-death
    signal (set when it was first started) keeps pointing at the caller. Returns its PID.

    This is what CRIU's RPC ``rst_sibling`` sets (``opts.restore_sibling``); the command line
    reaches it with ``--restore-sibling``, so no protobuf bindings are needed (ADR 0007).
    """
    argv = ["restore", "-D", image_dir, "-o", RESTORE_LOG, "--manage-cgroups=ignore",
            "--restore-detached", "--restore-sibling", "--pidfile", pidfile]
    _run(binary, argv + list(extra or ()), os.path.join(image_dir, RESTORE_LOG), "restore",
         timeout)
    with open(pidfile) as f:
        return int(f.read().strip())
