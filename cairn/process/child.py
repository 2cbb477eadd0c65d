"""``cairn run``'s workload as its child, and the signals that stop the run.

:class:`Child` starts the command fresh (the workload never outlives the supervisor: a fresh
child gets ``PR_SET_PDEATHSIG=SIGKILL``, a restored one keeps it because CRIU restores it as
the supervisor's child, and the supervisor is a child subreaper), reaps it, and kills its tree.
:class:`StopSignals` catches SIGTERM/SIGINT and SIGCHLD and wakes the supervisor's loop. Only
the main thread forks (a parent-death signal follows the *thread* that forked).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

from cairn.exceptions import ConfigError, CriuFailed
from cairn.process import pids as pids_mod
from cairn.process import workload
from cairn.runtime.exits import from_wait_status
from cairn.runtime.wakeup import Wakeup

log = logging.getLogger("cairn.run")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PID_WAIT_S = 30.0  # how long a restore waits for a killed predecessor's PIDs to be freed
# A platform that signals every process of the step (SLURM's proctrack, a process group) may
# kill the workload a moment before this run's own signal arrives: wait this long for it.
STOP_SIGNAL_WAIT_S = 0.5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "gone"
    return "a zombie not yet reaped" if state == "Z" else (cmd[:80] or "?")


def wait_for_pids(wanted: Sequence[int]) -> None:
    """CRIU needs a snapshot's PIDs free. A killed predecessor's processes may still be
    exiting, or be zombies the container's init has yet to reap: wait for them a while, then
    name whatever still holds a PID (CriuFailed)."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        taken = [p for p in wanted if os.path.exists(f"/proc/{p}")]
        if not taken:
            return
        if time.monotonic() > deadline:
            holders = ", ".join(f"{p} ({describe_pid(p)})" for p in taken[:5])
            raise CriuFailed(f"the snapshot's PIDs are still in use after {PID_WAIT_S:.0f}s: "
                             f"{holders}; stop those processes, or run the step on another "
                             "worker")
        time.sleep(0.1)


def kill_tree(root: int) -> None:
    """SIGKILL ``root``'s process tree, leaves first (signals only: safe from any thread)."""
    for pid in reversed(workload.process_tree(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class StopSignals:
    """SIGTERM/SIGINT (the first one is kept, with when it came) and SIGCHLD, each waking
    :attr:`wake` (see :mod:`cairn.runtime.wakeup` for why a pipe). Install from the main
    thread."""

    def __init__(self) -> None:
        self.wake = Wakeup()
        self.signum: int | None = None
        self.at = 0.0  # time.monotonic() of the first stop signal

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGCHLD, self._on_child)

    @property
    def name(self) -> str:
        assert self.signum is not None
        return signal.Signals(self.signum).name

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
        self.wake.set()

    def _on_child(self, _signum: int, _frame: object) -> None:
        self.wake.set()

    def came_with(self, status: int) -> bool:
        """Whether a workload that ended with wait ``status`` ended of the stop this run was
        told of rather than of its own failure: it ended unsuccessfully once this run had a
        stop signal, or it died of SIGTERM or SIGINT and this run's own signal came within
        :data:`STOP_SIGNAL_WAIT_S` (the platform signals every process of the step, in no set
        order)."""
        if from_wait_status(status) == 0:
            return False
        if self.signum is None and os.WIFSIGNALED(status) and \
                os.WTERMSIG(status) in STOP_SIGNALS:
            deadline = time.monotonic() + STOP_SIGNAL_WAIT_S
            while self.signum is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the signal handler runs in between
        return self.signum is not None

    def close(self) -> None:
        self.wake.close()


class Child:
    """The workload's root process: started fresh (:meth:`spawn`) or restored by CRIU
    (:meth:`adopt`), reaped (:meth:`reap`) and killed (:meth:`kill`). ``pid`` None: none."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def adopt(self, pid: int) -> None:
        """A restored workload, CRIU's child restored as this process's own."""
        self.pid, self._proc = pid, None

    def spawn(self, argv: Sequence[str], *, stdout_path: str, stderr_path: str,
              ignores_sigterm: bool) -> None:
        """Start ``argv`` fresh, its output appended to the two (emptied) log files, at a high
        PID where it can (a restore in a fresh container then finds its PIDs free)."""
        for path in (stdout_path, stderr_path):
            open(path, "wb").close()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the log (and the echo) at once
        supervisor = os.getpid()

        def in_child() -> None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if ignores_sigterm:  # inherited through exec, kept by a restore
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if os.getppid() != supervisor:  # the supervisor died before prctl took effect
                os._exit(1)

        def spawn() -> subprocess.Popen[bytes]:
            # O_APPEND: CRIU then records the position, and cairn can cut the file back.
            with open(stdout_path, "ab") as out, open(stderr_path, "ab") as err:
                return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True, env=env,
                                        preexec_fn=in_child)

        try:
            proc = pids_mod.spawn_at(pids_mod.high_pid_base(), spawn)
        except OSError as e:
            if isinstance(e, (FileNotFoundError, PermissionError)) and e.filename == argv[0]:
                raise ConfigError(f"cannot run {argv[0]!r}: {e.strerror}") from None
            log.warning("cannot move ns_last_pid (%s); the workload starts at a low PID that "
                        "a restore in a fresh container may find taken", e)
            proc = spawn()
        self._proc = proc  # held so that subprocess never reaps it behind waitpid's back
        self.pid = proc.pid
        log.warning("started %s (pid %d)", " ".join(argv), self.pid)

    def reap(self) -> int | None:
        """Reap exited children (adopted orphans too); the workload's wait status once it
        ended (``pid`` is None from then)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == 0:
                return None
            if pid == self.pid:
                self.pid = None
                if self._proc is not None and self._proc.pid == pid:
                    self._proc.returncode = from_wait_status(status)
                return status

    def kill(self) -> None:
        """SIGKILL the workload's tree and reap it."""
        pid = self.pid
        if pid is None:
            return
        kill_tree(pid)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        self.pid = None
