"""Drive ``cairn run`` from tests: start it in its own session, watch its store and output,
kill it the way a preemption or a crashed node would."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cairn.process import find_criu
from cairn.store import Key
from cairn import open_store

CRIU = find_criu()
SUPPORT = Path(__file__).parent
COUNTER = SUPPORT / "counter_steps.py"
TRAINING = SUPPORT / "criu_training.py"


def can_run_criu() -> bool:
    return os.geteuid() == 0 and CRIU is not None


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _state(pid: int) -> str | None:
    """The one-letter state in ``/proc/PID/stat``; None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it died between open and read
        return None
    return stat.rsplit(b")", 1)[1].split()[0].decode()


def gone(pid: int) -> bool:
    """``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    return _state(pid) in (None, "Z", "X")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(b")", 1)[1].split()[1]), []).append(int(name))
    out, stack = [], list(children.get(pid, []))
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


class CairnRun:
    """One ``cairn run`` process; its stdout/stderr go to files under ``logs``."""

    def __init__(self, *, store: str, key: str, command: Sequence[str], workdir: Path,
                 logs: Path, every: str = "1s", grace: str = "30s", extra: Sequence[str] = (),
                 env: dict[str, str] | None = None, cwd: Path | None = None,
                 prefix: Sequence[str] = ()) -> None:
        self.store, self.key = store, key
        logs.mkdir(parents=True, exist_ok=True)
        n = len(list(logs.glob("run-*.out")))
        self.out_path, self.err_path = logs / f"run-{n}.out", logs / f"run-{n}.err"
        # -X faulthandler (not the environment, which the workload would inherit): a hung
        # run can be asked for its threads' stacks with SIGABRT (see wait()).
        argv = [*prefix, sys.executable, "-X", "faulthandler", "-m", "cairn.cli.main", "run",
                "--store", store, "--key", key, "--every", every, "--grace", grace,
                "--workdir", str(workdir), *extra, "--", *command]
        self.workdir = workdir
        full_env = {**os.environ, **(env or {})}
        if CRIU is not None:
            full_env.setdefault("CAIRN_CRIU", CRIU)
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True, env=full_env,
                                         cwd=cwd or os.getcwd())

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def committed(self) -> list[int]:
        """Seqs of the snapshots this run reported committed."""
        return [int(m) for m in re.findall(r"snapshot seq (\d+) committed", self.stderr)]

    def child_pid(self) -> int | None:
        m = re.search(r"(?:started .* \(pid (\d+)\)|restored snapshot seq \d+ of key .* \(pid (\d+)\))",
                      self.stderr)
        return int(m.group(1) or m.group(2)) if m else None

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # Hung: say where, so that a failure in CI can be diagnosed from its output alone.
        processes = describe_processes([self.proc.pid, *descendants(self.proc.pid)])
        criu_logs = _criu_log_tails(self.workdir)
        os.kill(self.proc.pid, signal.SIGABRT)  # faulthandler writes every thread's stack
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        raise AssertionError(f"cairn run did not finish in {timeout}s\n{self.stderr}\n"
                             f"processes then:\n{processes}\n{criu_logs}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def snapshots(self) -> list[int]:
        with open_store(self.store, create=False) as store:
            return [info.seq for info in store.snapshots(Key.parse(self.key))]


def describe_processes(pids: Sequence[int]) -> str:
    """One line per process: pid, state, what it waits in (wchan), command line."""
    lines = []
    for pid in pids:
        proc, state = Path(f"/proc/{pid}"), _state(pid)
        try:
            wchan = (proc / "wchan").read_text(errors="replace")
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        lines.append(f"  {pid} {state} wchan={wchan or '-'} {argv.strip()[:200]}")
    return "\n".join(lines) or "  (none)"


def _criu_log_tails(workdir: Path, lines: int = 30) -> str:
    """The ends of the CRIU logs of dumps or restores still in ``workdir`` (a dump's image
    directory is removed once it is ingested, so one found here was in progress)."""
    out = []
    for log in sorted([*workdir.rglob("dump.log"), *workdir.rglob("restore.log")]):
        try:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:  # removed meanwhile: the dump finished after all
            continue
        out.append(f"{log}:\n" + "\n".join(tail))
    return "\n".join(out) or "(no CRIU log in the work directory)"


def metric_steps(path: Path) -> list[int]:
    return [int(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]


def kill_after_commits(run: CairnRun, snapshots: int, timeout: float = 180.0) -> None:
    """Kill ``run`` (supervisor and workload) once it reported ``snapshots`` commits, and wait
    for its workload to die: a try lost with its node, leaving those snapshots behind."""
    try:
        wait_for(lambda: len(run.committed()) >= snapshots or run.proc.poll() is not None,
                 timeout, f"{snapshots} snapshots")
        assert run.proc.poll() is None, run.stderr
        child = run.child_pid()
    finally:
        run.kill()
    wait_for(lambda: child is None or gone(child), 30, "the workload to die with its supervisor")
