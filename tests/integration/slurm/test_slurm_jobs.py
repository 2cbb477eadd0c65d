"""Batch jobs on a real SLURM cluster that resume from their snapshot after a requeue or a
preemption: ``examples/slurm/train.sbatch`` submitted as users would, in process mode
(``cairn run`` around a workload that knows nothing of cairn) and in state mode
(``Checkpointer.from_env()``).

Each workload appends ``<mode> <step> <restart count>`` to a progress log after every step,
opened per line. A try that ends in a final snapshot leaves no step to redo: the log holds every
step exactly once. A try killed without one (its final dump does not fit ``--grace``) redoes
the steps after its last periodic snapshot, once each, in the next try.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from cairn import open_store
from cairn.exceptions import NotFound
from cairn.store import Key
from cairn.store.outcomes import OutcomeKind
from tests.support.cairn_run import can_run_criu
from tests.support.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[3]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
VENV_BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.isolated, pytest.mark.slow]
needs_criu = pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)")


def read_progress(path: Path) -> list[tuple[str, int, int]]:
    rows = []
    for line in path.read_text().splitlines():
        mode, step, restarts = line.split()
        rows.append((mode, int(step), int(restarts)))
    return rows


class Job:
    """One submission of the example batch script and what it leaves behind."""

    def __init__(self, cluster: SlurmCluster, tmp_path: Path, *, mode: str, steps: int,
                 pause: float = 0.1, every: str = "2s", grace: str = "10s",
                 every_steps: int = 10) -> None:
        self.cluster = cluster
        self.store = tmp_path / "store"
        self.progress = tmp_path / "progress.log"
        self.output = tmp_path / "job.out"
        self.steps = steps
        env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
               "CAIRN_STORE": str(self.store), "CAIRN_MODE": mode, "CAIRN_EVERY": every,
               "CAIRN_GRACE": grace, "CAIRN_EVERY_STEPS": str(every_steps),
               # cairn run's logs and staging: the test's own (job ids restart with each cluster)
               "CAIRN_WORKDIR": str(tmp_path / "work")}
        # The low partition's job takes every CPU, so a high one can only start by preempting.
        self.id = cluster.sbatch(SBATCH, "python", "-m", "tests.support.slurm_workloads", mode,
                                 str(self.progress), str(steps), str(pause),
                                 options=("--exclusive", f"--output={self.output}"),
                                 env=env, cwd=ROOT)
        self.key = Key.parse(f"slurm/{cluster.cluster_name}/{self.id}")

    def wait_steps(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.progress.exists() and len(self.progress.read_text().splitlines()) >= count):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id}: fewer than {count} steps after {timeout}s; "
                                     f"{self.cluster.job(self.id)}\n{self.log()}")
            time.sleep(0.1)

    def wait_snapshot(self, timeout: float = 60.0) -> int:
        """The seq of the first periodic snapshot, once committed."""
        deadline = time.monotonic() + timeout
        while True:
            snaps = []
            try:
                with open_store(str(self.store), create=False) as store:
                    snaps = store.snapshots(self.key) if store.history(self.key) else []
            except NotFound:  # not there yet, or its directory made but not its config yet
                pass
            if snaps:
                return snaps[-1].seq
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id}: no snapshot after {timeout}s\n{self.log()}")
            time.sleep(0.2)

    def wait_done(self, restarts: int = 1, timeout: float = 180.0) -> dict[str, str]:
        info = self.cluster.wait_job(
            self.id, lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
            "the job to end", timeout=timeout)
        assert info["JobState"] == "COMPLETED", f"{info}\n{self.log()}"
        assert int(info["Restarts"]) == restarts, f"{info}\n{self.log()}"
        return info

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else "(no output)"

    def outcomes(self):  # noqa: ANN201 - a list of Outcome
        with open_store(str(self.store), create=False) as store:
            return store.records.outcomes(self.key)


def submit_high(cluster: SlurmCluster, tmp_path: Path) -> int:
    """A job on the high partition, which preempts the low one's (it needs the whole node)."""
    return cluster.sbatch(ROOT / "tests" / "support" / "slurm_high_job.sh",
                          options=("--partition=high", "--exclusive",
                                   f"--output={tmp_path / 'high.out'}"),
                          env={"HIGH_MARK": str(tmp_path / "high.ran")})


def assert_each_step_once(rows: list[tuple[str, int, int]], steps: int) -> None:
    assert [step for _, step, _ in rows] == list(range(steps)), rows


def assert_first_try_preempted(job: Job, *, final: bool, requested_at: float) -> None:
    first = job.outcomes()[0]
    assert first.outcome is OutcomeKind.PREEMPTED, (first, job.log())
    slurm = first.detail["slurm"]
    assert slurm["job_id"] == str(job.id) and slurm["restart_count"] == 0 and slurm["try"] == 1
    assert slurm["node"] == job.cluster.node and slurm["partition"] == "low"
    kept = first.progress.snapshot_seq
    if final:
        assert kept is not None, job.log()
    # How long the try took to stop after SLURM was asked (the docs' table).
    print(f"\njob {job.id}: try 1 ended {first.ended_at - requested_at:.2f}s after the request "
          f"({'final snapshot' if final else 'no final snapshot'}, seq {kept}); "
          f"GraceTime {job.cluster.timing.grace_s}s, KillWait {job.cluster.timing.kill_wait_s}s")


@needs_criu
def test_process_mode_requeue_resumes_from_the_final_snapshot(slurm_cluster: SlurmCluster,
                                                               tmp_path: Path) -> None:
    job = Job(slurm_cluster, tmp_path, mode="process", steps=60)
    job.wait_steps(15)
    requested = time.time()
    slurm_cluster.scontrol("requeue", str(job.id))
    job.wait_done()
    assert_first_try_preempted(job, final=True, requested_at=requested)
    rows = read_progress(job.progress)
    assert_each_step_once(rows, 60)
    second = job.outcomes()[1]
    assert second.outcome is OutcomeKind.SUCCEEDED
    assert second.detail["slurm"]["restart_count"] == 1 and second.detail["slurm"]["try"] == 2
    assert second.detail["resumed_from_seq"] == job.outcomes()[0].progress.snapshot_seq


@needs_criu
def test_process_mode_preemption_resumes_from_the_final_snapshot(slurm_cluster: SlurmCluster,
                                                                 tmp_path: Path) -> None:
    job = Job(slurm_cluster, tmp_path, mode="process", steps=60)
    job.wait_steps(15)
    requested = time.time()
    high = submit_high(slurm_cluster, tmp_path)
    job.wait_done()
    assert_first_try_preempted(job, final=True, requested_at=requested)
    assert slurm_cluster.job(high)["JobState"] == "COMPLETED"
    assert (tmp_path / "high.ran").exists()
    assert_each_step_once(read_progress(job.progress), 60)
    assert job.outcomes()[1].outcome is OutcomeKind.SUCCEEDED


def test_state_mode_requeue_resumes_from_the_final_snapshot(slurm_cluster: SlurmCluster,
                                                             tmp_path: Path) -> None:
    job = Job(slurm_cluster, tmp_path, mode="state", steps=60, every_steps=1000)
    job.wait_steps(15)
    requested = time.time()
    slurm_cluster.scontrol("requeue", str(job.id))
    job.wait_done()
    assert_first_try_preempted(job, final=True, requested_at=requested)
    rows = read_progress(job.progress)
    assert_each_step_once(rows, 60)
    restarts = [r for _, _, r in rows]
    assert restarts == sorted(restarts) and restarts[0] == 0 and restarts[-1] == 1, rows


def test_state_mode_preemption_resumes_from_the_final_snapshot(slurm_cluster: SlurmCluster,
                                                               tmp_path: Path) -> None:
    job = Job(slurm_cluster, tmp_path, mode="state", steps=60, every_steps=1000)
    job.wait_steps(15)
    requested = time.time()
    high = submit_high(slurm_cluster, tmp_path)
    job.wait_done()
    assert_first_try_preempted(job, final=True, requested_at=requested)
    assert slurm_cluster.job(high)["JobState"] == "COMPLETED"
    assert_each_step_once(read_progress(job.progress), 60)


@needs_criu
def test_a_final_dump_that_does_not_fit_resumes_from_the_last_periodic_snapshot(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # --grace below the measured dump: cairn run leaves the workload to SLURM's SIGKILL and
    # exits 76, as it would when a preemption's GraceTime is shorter than a dump.
    job = Job(slurm_cluster, tmp_path, mode="process", steps=60, every="1s", grace="0.01s")
    job.wait_snapshot()
    job.wait_steps(len(job.progress.read_text().splitlines()) + 10)
    requested = time.time()
    slurm_cluster.scontrol("requeue", str(job.id))
    job.wait_done()
    assert_first_try_preempted(job, final=False, requested_at=requested)
    first = job.outcomes()[0]
    assert first.detail["exit_code"] == 76
    second = job.outcomes()[1]
    assert second.outcome is OutcomeKind.SUCCEEDED
    assert second.detail["resumed_from_seq"] == first.progress.snapshot_seq is not None
    # The first try's steps, then the resumed try's from the snapshot on: each step after the
    # resume point exactly once, and the resumed part reaches the end. When the kill lands
    # before the workload logs a step past the kept snapshot, nothing is redone and the log
    # holds every step once (seen in CI: killed 0.06 s after the request).
    steps = [step for _, step, _ in read_progress(job.progress)]
    drops = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert len(drops) <= 1, steps
    resume_at = drops[0] if drops else len(steps)
    before, after = steps[:resume_at], steps[resume_at:]
    assert before == list(range(len(before))), steps
    if after:
        assert after == list(range(after[0], 60)) and after[0] < len(before), steps
    else:
        assert before == list(range(60)), steps
