"""``cairn run`` dumps and restores, with real CRIU, of a workload that registered with the
FAKE CUDA driver (native/fakecuda, loaded through CAIRN_CUDA_LIBRARY): the driver calls
around each dump and restore go through cairn's real ctypes path, and the fake records what
it received. No GPU is involved; scripts/gpu_check.py is the check on a real one."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest

from cairn.store import Key
from cairn import open_store
from cairn.store.outcomes import OutcomeKind
from tests.support.cairn_run import CairnRun, can_run_criu, descendants, gone, metric_steps, \
    wait_for
from tests.support.fakecuda import GIB, UUID_A, UUID_B, FakeDriver, Gpu, fake_library

WORKLOAD = Path(__file__).resolve().parents[2] / "support" / "fake_gpu_workload.py"
STEPS = 300
MOVES = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
         "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]


@pytest.fixture()
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(tmp_path)  # the metrics file is in the working directory, a track root
    work = tmp_path / "workspace"
    work.mkdir()
    driver = FakeDriver(tmp_path, fake_library())
    return {"store": str(tmp_path / "store"), "work": work, "logs": tmp_path / "logs",
            "metrics": work / "metrics.txt", "driver": driver,
            "control": tmp_path / "fakecuda-control"}


def _run(place: dict, *gpus: Gpu, grace: str = "30s", every: str = "1s", **env: str) -> CairnRun:
    driver: FakeDriver = place["driver"]
    full = {**driver.env, **driver.gpus(*gpus), "FAKE_GPU_MEMORY": f"{UUID_A}={2 * GIB}",
            "FAKECUDA_CONTROL": str(place["control"]), **env}
    return CairnRun(store=place["store"], key="gpu/fake/1",
                    command=[sys.executable, str(WORKLOAD), str(place["metrics"]), str(STEPS),
                             "0.02"],
                    workdir=place["work"] / "cairn", logs=place["logs"], every=every,
                    grace=grace, env=full)


def _after_snapshots(run: CairnRun, count: int) -> None:
    wait_for(lambda: len(run.committed()) >= count or run.proc.poll() is not None, 120,
             f"{count} snapshot(s)")
    assert run.proc.poll() is None, run.stderr


def _killed(run: CairnRun) -> None:
    tree = descendants(run.proc.pid)
    run.kill()
    wait_for(lambda: all(gone(p) for p in tree), 30, "the workload to die with its supervisor")


def _moves(driver: FakeDriver, caller: int | None = None) -> list[str]:
    return [c["call"].removeprefix("cuCheckpointProcess") for c in driver.calls(*MOVES)
            if c["rc"] == 0 and (caller is None or c["caller"] == caller)]


def test_dumps_lock_checkpoint_restore_unlock_and_a_retry_remaps(place: dict) -> None:
    driver: FakeDriver = place["driver"]
    first = _run(place, Gpu(UUID_A))
    try:
        _after_snapshots(first, 2)
        workload_pid = first.child_pid()
    finally:
        _killed(first)
    # Each periodic dump: lock, checkpoint, CRIU, then restore and unlock (leave running),
    # the lock's timeout half the dump's time left (at most 60 s), onto the same GPU.
    periodic = _moves(driver, first.proc.pid)
    assert len(periodic) >= 8 and periodic[:8] == ["Lock", "Checkpoint", "Restore", "Unlock"] * 2
    locks = driver.calls("cuCheckpointProcessLock")
    assert {c["timeout_ms"] for c in locks} == {60_000} and {c["pid"] for c in locks} == {
        workload_pid}
    assert all(c["pairs"] == [] for c in driver.calls("cuCheckpointProcessRestore"))

    # The retry lands on a node whose GPU has another UUID.
    second = _run(place, Gpu(UUID_B))
    assert second.wait(120) == 0, second.stderr
    assert "restored snapshot seq" in second.stderr, second.stderr
    assert f"onto other GPUs: {UUID_A} -> {UUID_B}" in second.stderr
    restores = [c for c in driver.calls("cuCheckpointProcessRestore")
                if c["caller"] == second.proc.pid]
    assert restores[0]["pairs"] == [[UUID_A, UUID_B]] and restores[0]["rc"] == 0
    assert _moves(driver, second.proc.pid)[:2] == ["Restore", "Unlock"]
    assert driver.gpus_of(workload_pid) == [UUID_B]
    assert metric_steps(place["metrics"]) == list(range(STEPS))  # resumed, none lost


def test_a_driver_too_old_to_remap_starts_fresh_with_the_reason(place: dict) -> None:
    old = "570.133.20"
    first = _run(place, Gpu(UUID_A), FAKECUDA_DRIVER=old)
    try:
        _after_snapshots(first, 1)
    finally:
        _killed(first)
    second = _run(place, Gpu(UUID_B), FAKECUDA_DRIVER=old, FAKE_GPU_MEMORY=f"{UUID_B}={GIB}")
    assert second.wait(120) == 0, second.stderr
    fresh = re.search(r"starting fresh: snapshot seq \d+ does not fit: (.*)", second.stderr)
    assert fresh, second.stderr
    assert fresh.group(1) == (f"the snapshot's GPUs are not here ({UUID_A} -> {UUID_B}) and "
                              f"driver {old} cannot restore onto other GPUs (that needs 580+)")
    # Nothing of the snapshot was handed to the driver: only the fresh workload's own dumps.
    fresh_pid = second.child_pid()
    assert all(c["pid"] == fresh_pid and c["pairs"] == []
               for c in place["driver"].calls("cuCheckpointProcessRestore")
               if c["caller"] == second.proc.pid)
    assert metric_steps(place["metrics"])[-STEPS:] == list(range(STEPS))  # from step 0


def test_a_failed_checkpoint_keeps_the_previous_snapshot(place: dict) -> None:
    run = _run(place, Gpu(UUID_A))
    try:
        _after_snapshots(run, 1)
        kept = run.snapshots()
        place["control"].write_text("fail=cuCheckpointProcessCheckpoint=999\n")
        wait_for(lambda: "snapshot failed" in run.stderr, 30, "a failed snapshot")
        assert "may be unusable" in run.stderr, run.stderr
        assert run.snapshots()[-1] == kept[-1]  # the last committed snapshot stands
    finally:
        _killed(run)


def test_gpu_memory_the_host_cannot_hold_is_refused_before_the_dump(place: dict) -> None:
    run = _run(place, Gpu(UUID_A, total=1 << 50), FAKE_GPU_MEMORY=f"{UUID_A}={1 << 49}")
    try:
        wait_for(lambda: "snapshot failed" in run.stderr, 60, "a refused snapshot")
        assert "of host RAM is available for the checkpoint copy" in run.stderr, run.stderr
        assert place["driver"].calls("cuCheckpointProcessLock") == []  # nothing was stopped
    finally:
        _killed(run)


def test_a_periodic_dump_whose_gpu_copy_outlasts_the_grace_is_refused(place: dict) -> None:
    # 8 GiB at the assumed 10 GB/s is about 0.9 s, more than a 0.5 s grace.
    run = _run(place, Gpu(UUID_A), grace="0.5s", FAKE_GPU_MEMORY=f"{UUID_A}={8 * GIB}")
    try:
        wait_for(lambda: "snapshot failed" in run.stderr, 60, "a refused snapshot")
        assert "longer than the 0.5s grace period" in run.stderr, run.stderr
        assert "(assumed)" in run.stderr and "state mode" in run.stderr
        assert place["driver"].calls("cuCheckpointProcessLock") == []
    finally:
        _killed(run)


def test_a_first_final_dump_counts_the_gpu_copy_in_its_estimate(place: dict) -> None:
    run = _run(place, Gpu(UUID_A), grace="1s", every="1h", FAKE_GPU_MEMORY=f"{UUID_A}={16 * GIB}")
    wait_for(lambda: place["metrics"].exists(), 60, "the workload to start")
    run.signal(signal.SIGTERM)
    assert run.wait(30) == 76, run.stderr  # no final snapshot tried: it could not fit
    assert re.search(r"no final snapshot: no snapshot measured yet; .* plus the GPU copy of "
                     r"16\.0 GiB of GPU memory at 10\.0 GB/s \(assumed\) is about 1\.7s: "
                     r"together \d+\.\ds", run.stderr), run.stderr
    assert place["driver"].calls("cuCheckpointProcessLock") == []


def test_a_lock_that_hangs_on_notice_times_out_inside_the_grace(place: dict) -> None:
    status_file = place["work"] / "status.json"
    run = _run(place, Gpu(UUID_A), grace="4s", CAIRN_STATUS_FILE=str(status_file))
    _after_snapshots(run, 1)
    place["control"].write_text("hang=cuCheckpointProcessLock\n")
    run.signal(signal.SIGTERM)
    assert run.wait(30) == 76, run.stderr  # preempted, the previous snapshot kept
    final_lock = place["driver"].calls("cuCheckpointProcessLock")[-1]
    assert final_lock["rc"] == 909 and 0 < final_lock["timeout_ms"] <= 2000, final_lock
    assert "did not stop within" in run.stderr
    assert "CUDA_ERROR_TIMEOUT" in run.stderr  # the driver's code named, not a bare number

    # The GPU stall (lock -> unlock) of the committed snapshots is reported beside CRIU's
    # frozen time: in each log line, status.json and the outcome record, where it encloses
    # the frozen time (the CRIU dump runs while the GPU is locked).
    parts = re.findall(r"frozen \d+ ms \(CRIU\), GPU stalled (\d+) ms \(lock to unlock; "
                       r"lock (\d+) ms \+ checkpoint (\d+) ms\)", run.stderr)
    stalls = [float(stall) for stall, _, _ in parts]
    assert all(int(stall) >= int(lock) + int(ckpt) - 1 for stall, lock, ckpt in parts), parts
    assert len(stalls) == len(run.committed()) >= 1, run.stderr
    status = json.loads(status_file.read_text())
    with open_store(place["store"], create=False) as store:
        (outcome,) = store.records.outcomes(Key.parse("gpu/fake/1"))
    assert outcome.outcome is OutcomeKind.PREEMPTED
    assert outcome.gpu_stall_s == pytest.approx(status["gpu_stall_seconds"], abs=1e-3)
    assert outcome.frozen_s == pytest.approx(status["frozen_seconds"], abs=1e-3)
    assert 0 < outcome.frozen_s < outcome.gpu_stall_s
    assert outcome.gpu_stall_s == pytest.approx(sum(stalls) / 1000, abs=0.01)
