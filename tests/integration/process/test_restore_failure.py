"""``cairn run`` whose restore fails on its own side, with real CRIU: an injected library
failure (``tests.support.read_failure``) while fetching the images, while streaming the pages
to CRIU, or while a lazy restore serves them to the running workload. Each ends the try with
exit 8 naming the cause: the workload is neither started fresh nor restored from an older
snapshot, every snapshot stays, and the next run restores the newest (issue 32 item 4).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cairn.process import criu as criu_mod
from cairn.runtime.exits import ExitCode
from tests.support.cairn_run import COUNTER, CRIU, CairnRun, can_run_criu, kill_after_commits, \
    metric_steps
from tests.support.read_failure import INJECTED, injecting_env

pytestmark = [
    pytest.mark.isolated,  # CRIU restores at fixed PIDs
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]

STEPS = 120
KEY = "dag/restore-failure/1"


def counter(tmp_path: Path, *, restore: str = "eager",
            env: dict[str, str] | None = None) -> CairnRun:
    work = tmp_path / "workspace"
    work.mkdir(exist_ok=True)
    return CairnRun(store=str(tmp_path / "store"), key=KEY,
                    command=[sys.executable, str(COUNTER), str(work / "metrics.txt"), str(STEPS),
                             "0.05"],
                    workdir=work / "cairn", logs=tmp_path / "logs", every="1s",
                    extra=["--restore", restore], env=env, cwd=tmp_path)


NO_UFFD = pytest.mark.skipif(CRIU is None or not criu_mod.has_feature(CRIU, "uffd-noncoop"),
                             reason="this kernel has no userfaultfd for CRIU")


@pytest.mark.parametrize("where, restore", [
    ("part", "eager"),      # the images fetched before CRIU
    ("chunks", "eager"),    # the pages streamed to CRIU (a short pipe, not a host problem)
    pytest.param("lazy", "lazy", marks=NO_UFFD),  # the first page a restored task faults on
    pytest.param("lazy-fill", "lazy", marks=NO_UFFD),  # while the restored workload runs
])
def test_a_restore_failing_on_this_side_exits_8_and_skips_nothing(
        tmp_path: Path, where: str, restore: str) -> None:
    first = counter(tmp_path)
    kill_after_commits(first, 2)
    snapshots = first.snapshots()
    assert len(snapshots) >= 2

    failed = counter(tmp_path, restore=restore,
                     env=injecting_env(tmp_path / "inject", where=where))
    assert failed.wait(180) == ExitCode.RESTORE_FAILED, failed.stderr
    err = failed.stderr
    assert f"ValueError: {INJECTED}" in err and f"snapshot seq {snapshots[0]}" in err, err
    assert "no snapshot was skipped" in err and "Traceback" in err  # the cause, with its stack
    assert "skipping snapshot" not in err and "trying the previous snapshot" not in err, err
    if where == "lazy-fill":
        assert f"the restore of snapshot seq {snapshots[0]} failed while the workload ran" in err
    assert "starting fresh" not in err and f"started {sys.executable}" not in err, err
    assert failed.snapshots() == snapshots  # nothing committed, nothing dropped

    resumed = counter(tmp_path)
    assert resumed.wait(300) == 0, resumed.stderr
    assert f"restored snapshot seq {snapshots[0]} of key" in resumed.stderr, resumed.stderr
    assert metric_steps(tmp_path / "workspace" / "metrics.txt") == list(range(STEPS)), \
        "each step exactly once: nothing was redone from an older snapshot or from 0"
