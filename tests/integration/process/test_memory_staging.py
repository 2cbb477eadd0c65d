"""``cairn run --staging memory`` with real CRIU: the dump is written to tmpfs, and the step
resumes from it after its supervisor was killed; ``--staging disk`` keeps it on disk.

Where CRIU wrote is seen by CRIU itself: ``CAIRN_CRIU`` points at a wrapper that records the
filesystem type of the ``-D`` directory of every dump (``stat -f``) and then runs the real
CRIU with the same arguments.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.runtime.env import CRIU as CRIU_VAR
from tests.support.cairn_run import COUNTER, CRIU, CairnRun, can_run_criu, gone, metric_steps, \
    wait_for

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]

STEPS = 300


def criu_recording_its_dumps(where: Path) -> tuple[Path, Path]:
    """A CRIU wrapper appending ``<fstype> <images dir>`` per dump to the returned record."""
    record, wrapper = where / "dumps.txt", where / "criu"
    wrapper.write_text(f"""#!/bin/sh
if [ "$1" = dump ]; then
  previous=
  for arg in "$@"; do
    if [ "$previous" = -D ]; then echo "$(stat -f -c %T "$arg") $arg" >> {record}; fi
    previous=$arg
  done
fi
exec {CRIU} "$@"
""")
    wrapper.chmod(0o755)
    return wrapper, record


def counter(tmp_path: Path, wrapper: Path, staging: str) -> CairnRun:
    work = tmp_path / "workspace"
    work.mkdir(exist_ok=True)
    return CairnRun(store=str(tmp_path / "store"), key="dag/staged/1",
                    command=[sys.executable, str(COUNTER), str(work / "metrics.txt"), str(STEPS),
                             "0.05"],
                    workdir=work / "cairn", logs=tmp_path / "logs", every="1s",
                    extra=["--staging", staging], env={CRIU_VAR.name: str(wrapper)},
                    cwd=tmp_path)


def killed_after_a_snapshot(run: CairnRun) -> None:
    """Wait for ``run``'s first committed snapshot, then SIGKILL it."""
    try:
        wait_for(lambda: run.committed() or run.proc.poll() is not None, 120, "a snapshot")
        assert run.proc.poll() is None, run.stderr
    finally:
        run.kill()


def dumps(record: Path) -> list[tuple[str, str]]:
    if not record.exists():
        return []
    return [tuple(line.split(" ", 1)) for line in record.read_text().splitlines()]  # type: ignore[misc]


def test_memory_staging_dumps_into_tmpfs_and_the_step_resumes(tmp_path: Path) -> None:
    wrapper, record = criu_recording_its_dumps(tmp_path)
    first = counter(tmp_path, wrapper, "memory")
    try:
        wait_for(lambda: len(first.committed()) >= 2 or first.proc.poll() is not None, 120,
                 "two snapshots")
        assert first.proc.poll() is None, first.stderr
        child = first.child_pid()
    finally:
        first.kill()
    wait_for(lambda: child is None or gone(child), 30, "the workload to die with its supervisor")
    seen = dumps(record)
    assert len(seen) >= 2 and all(kind == "tmpfs" for kind, _ in seen), seen
    memory_dir = re.search(r"staging the dump in memory at (\S+) \(--staging memory",
                           first.stderr).group(1)
    assert memory_dir.startswith("/dev/shm/cairn-"), first.stderr
    assert all(path.startswith(memory_dir + "/dump-") for _, path in seen), (seen, memory_dir)
    assert "MB in memory, dump" in first.stderr, "the committed line names the medium"

    second = counter(tmp_path, wrapper, "memory")
    assert second.wait(300) == 0, second.stderr
    assert "restored snapshot seq" in second.stderr, second.stderr
    metrics = tmp_path / "workspace" / "metrics.txt"
    assert metric_steps(metrics) == list(range(STEPS)), "each step exactly once"
    # The killed run's memory directory is gone with the second run, and so is its own.
    assert not os.path.exists(memory_dir)


def test_disk_staging_keeps_the_dump_in_the_work_directory(tmp_path: Path) -> None:
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout.strip()
    if kind == "tmpfs":
        pytest.skip("the temporary directory is itself on tmpfs")
    wrapper, record = criu_recording_its_dumps(tmp_path)
    run = counter(tmp_path, wrapper, "disk")
    killed_after_a_snapshot(run)
    seen = dumps(record)
    work = str(tmp_path / "workspace" / "cairn")
    assert seen and all(kind != "tmpfs" and path.startswith(work) for kind, path in seen), seen
    assert "staging the dump on disk at" in run.stderr and "(--staging disk)" in run.stderr


def test_a_killed_runs_memory_staging_goes_with_the_next_run_of_any_key(tmp_path: Path) -> None:
    wrapper, record = criu_recording_its_dumps(tmp_path)
    first = counter(tmp_path, wrapper, "memory")
    killed_after_a_snapshot(first)  # SIGKILL: the run cannot remove its memory directory
    memory_dir = re.search(r"staging the dump in memory at (\S+) \(--staging memory",
                           first.stderr).group(1)
    assert os.path.isdir(memory_dir), "the killed run's memory directory is left behind"
    work = tmp_path / "other"
    work.mkdir()
    other = CairnRun(store=str(tmp_path / "store"), key="dag/another/1",
                     command=[sys.executable, str(COUNTER), str(work / "metrics.txt"), "40",
                              "0.05"],
                     workdir=work / "cairn", logs=tmp_path / "other-logs", every="1s",
                     extra=["--staging", "disk"], cwd=tmp_path)
    assert other.wait(300) == 0, other.stderr
    assert f"removed {memory_dir}: " in other.stderr and "a killed cairn run had staged in " \
        "memory" in other.stderr, other.stderr
    assert not os.path.exists(memory_dir)
