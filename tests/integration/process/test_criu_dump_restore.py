"""CRIU on this host, for real: checkpoint a running process, kill it, restore it, and see it
carry on from where it stopped with the same PID. Needs root and CRIU >= 4 (``make test``
builds it with ``scripts/build_criu.sh`` first, so in CI these tests run rather than skip).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cairn.process import Status, find_criu, run_doctor
from tests.support.cairn_run import gone, wait_for

pytestmark = [pytest.mark.isolated, pytest.mark.slow]

CHILD = Path(__file__).with_name("counter_child.py")
CRIU = find_criu()

needs_criu = pytest.mark.skipif(
    os.geteuid() != 0 or CRIU is None,
    reason="needs root and a criu binary (run `sudo bash scripts/build_criu.sh`, or `make test` as root)",
)


def _counts(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().splitlines()]


def _log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return f"({path.name} missing)"
    return f"--- {path.name} (last {lines} lines) ---\n" + "\n".join(path.read_text().splitlines()[-lines:])


def _criu(*args: str, log_dir: Path, log: str) -> subprocess.CompletedProcess[str]:
    assert CRIU is not None
    done = subprocess.run([CRIU, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, (f"criu {args[0]} exited {done.returncode}\n{done.stdout}{done.stderr}\n"
                                  + _log_tail(log_dir / log))
    return done


@needs_criu
def test_dump_kills_and_restore_continues_with_the_same_pid(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    counter = tmp_path / "counter.txt"
    # Its own session with no terminal, and no descriptor shared with pytest: CRIU then dumps
    # the tree as is (no --shell-job, no --inherit-fd) and restores it without pytest.
    with open(tmp_path / "child.out", "wb") as out, open(tmp_path / "child.err", "wb") as err:
        child = subprocess.Popen([sys.executable, str(CHILD), str(counter)], stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=err, start_new_session=True, cwd=tmp_path)
    pid = child.pid
    restored: int | None = None
    try:
        wait_for(lambda: counter.exists() and len(_counts(counter)) >= 10, 15, "the child to count to 10")

        # Dumping kills the process by default (no --leave-running).
        _criu("dump", "-t", str(pid), "-D", str(images), "--manage-cgroups=ignore",
              "-v4", "-o", "dump.log", log_dir=images, log="dump.log")
        # Reap it: a zombie would keep its PID, and restore needs that PID free.
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert not Path(f"/proc/{pid}").exists()
        at_dump = _counts(counter)
        time.sleep(0.3)
        assert _counts(counter) == at_dump, "the process wrote after it was dumped"
        assert (images / f"core-{pid}.img").exists()

        pidfile = tmp_path / "restored.pid"
        _criu("restore", "-D", str(images), "-d", "--manage-cgroups=ignore", "--pidfile", str(pidfile),
              "-v4", "-o", "restore.log", log_dir=images, log="restore.log")
        restored = int(pidfile.read_text()) if pidfile.exists() else pid
        assert restored == pid
        assert CHILD.name in Path(f"/proc/{restored}/cmdline").read_text()

        wait_for(lambda: len(_counts(counter)) >= len(at_dump) + 10, 15,
                  "the restored process to count on")
        counts = _counts(counter)
        # One unbroken run: the restored process went on from memory, not from 0.
        assert counts == list(range(len(counts))), f"counts broke at the restore: {counts[len(at_dump) - 3:]}"
        assert len(counts) > len(at_dump)
    finally:
        if child.returncode is None:  # the test failed before the dump killed it
            child.kill()
            child.wait(timeout=10)
        if restored is not None:
            # Restored detached, it is init's child now: kill it and wait for it to stop.
            if not gone(restored):
                os.kill(restored, signal.SIGKILL)
            wait_for(lambda: gone(restored), 10, f"restored pid {restored} to exit")


@needs_criu
def test_doctor_reports_criu_ok() -> None:
    report = run_doctor()
    for name in ("criu", "criu check"):
        check = report.check(name)
        assert check.status is Status.OK, report.format_text()
    assert report.ok, report.format_text()


@needs_criu
def test_a_dump_inside_torchs_shared_memory_window_restores(tmp_path: Path) -> None:
    """A DataLoader worker frozen between creating its /dev/shm/torch_* file and unlinking it:
    the dump records the file by path, the worker unlinks it once thawed, and the restore
    needs it back. cairn recreates it, zero-filled at its dumped size, as it was."""
    from cairn.process import criu as criu_mod
    from cairn.process import torch_shm

    child_script = Path(__file__).with_name("shm_window_child.py")
    shm = Path(f"/dev/shm/torch_{os.getpid()}_{time.monotonic_ns() % 10**9}_1")
    out, images = tmp_path / "child.out", tmp_path / "images"
    images.mkdir()
    with open(tmp_path / "child.err", "wb") as err:
        child = subprocess.Popen([sys.executable, str(child_script), str(shm), str(out)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True, cwd=tmp_path)
    restored: int | None = None
    try:
        wait_for(lambda: out.exists() and "ready" in out.read_text(), 15, "the child to be ready")
        assert CRIU is not None
        criu_mod.dump(CRIU, child.pid, str(images), leave_running=False)
        child.wait(10)
        shm.unlink()  # what the thawed worker does a moment after the dump
        made = torch_shm.recreate(images)
        assert made == [str(shm)] and shm.stat().st_size == 3 * os.sysconf("SC_PAGE_SIZE")
        restored = criu_mod.restore(CRIU, str(images), pidfile=str(tmp_path / "pid"))
        os.kill(restored, signal.SIGUSR1)
        wait_for(lambda: "ok" in out.read_text(), 15, "the restored child to finish")
        assert "ok zeros=True unlinked=True" in out.read_text()
        assert not shm.exists()
    finally:
        for pid in (child.pid, restored):
            if pid is not None and not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if shm.exists():
            shm.unlink()
