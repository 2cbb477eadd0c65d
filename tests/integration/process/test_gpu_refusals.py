"""``cairn run`` refuses, before the GPU is locked, a process-mode workload that talks to
other GPUs or processes (issue 17 item 6): each workload registers with the FAKE CUDA driver
(native/fakecuda) and holds, for real, the descriptor, mapping, peer or socket in question
(tests/support/fake_gpu_sharing_workload.py). The refusal is one line naming state mode under
torchrun; the workload keeps running and nothing is left locked. A workload that merely loads
NCCL is snapshotted."""

from __future__ import annotations

import os
import re
import socket
import stat
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.cairn_run import CairnRun, can_run_criu, descendants, gone, metric_steps, \
    wait_for
from tests.support.fakecuda import GIB, UUID_A, FakeDriver, Gpu, fake_library

WORKLOAD = Path(__file__).resolve().parents[2] / "support" / "fake_gpu_sharing_workload.py"
FIX = "use state mode (cairn.Checkpointer; multi-GPU or multi-process jobs under torchrun"

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]


@pytest.fixture()
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "workspace"
    work.mkdir()
    tag = f"cairn-test-{uuid.uuid4().hex[:12]}"
    yield {"store": str(tmp_path / "store"), "work": work, "logs": tmp_path / "logs",
           "metrics": work / "metrics.txt", "driver": FakeDriver(tmp_path, fake_library()),
           "tag": tag, "tmp": tmp_path}
    for name in os.listdir("/dev/shm"):
        if tag in name:
            os.unlink(os.path.join("/dev/shm", name))


def _run(place: dict, mode: str, *gpus: Gpu, **env: str) -> CairnRun:
    driver: FakeDriver = place["driver"]
    full = {**driver.env, **driver.gpus(*(gpus or (Gpu(UUID_A),))),
            "FAKE_GPU_MEMORY": f"{UUID_A}={GIB}", "FAKE_SHM_TAG": place["tag"], **env}
    return CairnRun(store=place["store"], key="gpu/refusals/1",
                    command=[sys.executable, str(WORKLOAD), mode, str(place["metrics"]), "3000",
                             "0.02"],
                    workdir=place["work"] / "cairn", logs=place["logs"], every="1s",
                    grace="30s", env=full)


def _refused(place: dict, run: CairnRun) -> str:
    """The refusal's line; the workload is left running and unlocked, then killed."""
    try:
        wait_for(lambda: "snapshot failed" in run.stderr or run.proc.poll() is not None, 60,
                 "a refused snapshot")
        assert run.proc.poll() is None, run.stderr
        lines = run.stderr.splitlines()
        at = next(i for i, line in enumerate(lines) if "snapshot failed" in line)
        assert lines[at].endswith("cannot snapshot the workload:"), lines[at]
        refusal = lines[at + 1].strip()
        assert FIX in refusal, refusal
        steps = len(metric_steps(place["metrics"]))
        wait_for(lambda: len(metric_steps(place["metrics"])) > steps + 5, 30,
                 "the workload to keep counting")
        assert run.committed() == []
        return refusal
    finally:
        tree = descendants(run.proc.pid)
        run.kill()
        wait_for(lambda: all(gone(p) for p in tree), 30, "the workload to die")


def _never_locked(place: dict) -> None:
    assert place["driver"].calls("cuCheckpointProcessLock") == []


def test_a_second_cuda_process_in_the_tree_is_refused(place: dict) -> None:
    refusal = _refused(place, run := _run(place, "peer"))
    assert re.match(r"2 processes of the workload hold CUDA contexts \(pids \d+, \d+\): a "
                    r"multi-process GPU job", refusal), refusal
    assert "holding: peer" in run.stdout
    _never_locked(place)


def test_nccl_shared_memory_is_refused(place: dict) -> None:
    refusal = _refused(place, _run(place, "nccl-shm"))
    assert f"holds NCCL shared-memory segments (it talks to other ranks): /dev/shm/nccl-" \
           f"{place['tag']} (pids " in refusal, refusal
    _never_locked(place)


def test_cuda_ipc_shared_memory_is_refused(place: dict) -> None:
    refusal = _refused(place, _run(place, "cuda-ipc"))
    assert f"the CUDA driver's IPC/MPS shared memory: /dev/shm/cuda.shm.0.{place['tag']}.1" \
        in refusal, refusal
    _never_locked(place)


def test_an_open_infiniband_device_is_refused(place: dict) -> None:
    # A stand-in device node: no RDMA hardware here. The name is what a verbs device is
    # called under /dev/infiniband; its numbers are /dev/null's.
    ib = Path("/dev/infiniband")
    made_dir = not ib.exists()
    node = ib / f"uverbs-{place['tag']}"
    try:
        ib.mkdir(exist_ok=True)
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("needs root to make a stand-in /dev/infiniband node")
    try:
        refusal = _refused(place, _run(place, "infiniband", FAKE_IB_DEVICE=str(node)))
        assert f"holds InfiniBand/RDMA devices: {node} (pids " in refusal, refusal
        _never_locked(place)
    finally:
        node.unlink()
        if made_dir:
            ib.rmdir()


def test_an_mps_client_is_refused(place: dict) -> None:
    pipes = place["tmp"] / "mps"
    pipes.mkdir()
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # stands in for nvidia-cuda-mps-control
    daemon.bind(str(pipes / "control"))
    daemon.listen(1)
    try:
        # Where cairn sees the pipe too, its preflight refuses before the workload starts.
        early = _run(place, "mps", CUDA_MPS_PIPE_DIRECTORY=str(pipes))
        assert early.wait(60) == 7, early.stderr
        assert "MPS is in use (a control pipe is set up)" in early.stderr
        # Where only the workload sets it, the check before each dump does.
        refusal = _refused(place, _run(place, "mps", FAKE_MPS_DIR=str(pipes)))
        assert f"the workload is an MPS client ({pipes}/control, pids " in refusal, refusal
        assert "without the MPS daemon" in refusal
        _never_locked(place)
    finally:
        daemon.close()


def test_a_process_nvml_lists_as_an_mps_client_is_refused(place: dict) -> None:
    # No pipe in sight of the workload (another mount namespace, say): NVML still lists it
    # among the GPU's MPS clients.
    refusal = _refused(place, _run(place, "plain", FAKECUDA_MPS_CLIENT="1"))
    assert re.match(rf"the workload is an MPS client \(NVML lists pids \d+ as MPS clients of "
                    rf"GPU {UUID_A}\): the driver cannot checkpoint MPS clients", refusal), refusal
    _never_locked(place)


def test_mig_is_refused(place: dict) -> None:
    # MIG mode on (NVML): cairn's preflight refuses before the workload starts.
    early = _run(place, "plain", Gpu(UUID_A, mig=1))
    assert early.wait(60) == 7, early.stderr
    assert "MIG is enabled on GPU 0" in early.stderr
    # A workload that sees MIG devices: the check before each dump refuses.
    mig = "MIG-aaaaaaaa-1111-2222-3333-444444444444"
    refusal = _refused(place, _run(place, "plain", CUDA_VISIBLE_DEVICES=mig))
    assert re.match(r"pids \d+ see MIG devices \(CUDA_VISIBLE_DEVICES\): the driver cannot "
                    r"checkpoint MIG instances; run it on whole GPUs without MIG", refusal), refusal
    _never_locked(place)


def test_uvm_memory_the_driver_will_not_checkpoint_is_refused_and_unlocked(place: dict) -> None:
    # UVM leaves no trace in /proc: the driver says so at the checkpoint (NOT_SUPPORTED),
    # before anything moved; the lock is given back.
    driver: FakeDriver = place["driver"]
    run = _run(place, "plain", FAKECUDA_FAIL="cuCheckpointProcessCheckpoint=801")
    try:
        wait_for(lambda: "snapshot failed" in run.stderr, 60, "a refused snapshot")
        line = next(x for x in run.stderr.splitlines() if "snapshot failed" in x)
        assert "UVM/managed memory and CUDA IPC are not supported" in line and FIX in line
        pid = run.child_pid()
        assert pid is not None
        wait_for(lambda: driver.calls("cuCheckpointProcessUnlock"), 10, "the unlock")
        moves = [(c["call"].removeprefix("cuCheckpointProcess"), c["rc"]) for c in
                 driver.calls("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                              "cuCheckpointProcessUnlock") if c["pid"] == pid]
        # Each try: locked, refused at the checkpoint, unlocked again (the next period's try
        # may be under way, so only whole tries are compared).
        whole = moves[:3 * (len(moves) // 3)]
        assert whole and whole == [("Lock", 0), ("Checkpoint", 801), ("Unlock", 0)] * (
            len(whole) // 3), moves
        assert run.committed() == []
    finally:
        tree = descendants(run.proc.pid)
        run.kill()
        wait_for(lambda: all(gone(p) for p in tree), 30, "the workload to die")


def test_a_workload_that_only_loads_nccl_is_snapshotted(place: dict) -> None:
    # Every CUDA build of torch maps libnccl.so; loading it (and torch.distributed, where
    # torch is installed) without talking to a peer is a single-GPU workload.
    lib = place["tmp"] / "lib" / "libnccl.so.2"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF" + bytes(8188))
    run = _run(place, "libnccl", FAKE_LIBNCCL=str(lib))
    try:
        wait_for(lambda: run.committed() or run.proc.poll() is not None, 120, "a snapshot")
        assert run.committed(), run.stderr
        assert "snapshot failed" not in run.stderr, run.stderr
        pid = run.child_pid()
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        assert str(lib) in maps
        if "torch" in sys.modules or _has_torch():
            assert "/torch/" in maps  # torch.distributed was imported
        assert "GPU stalled" in run.stderr  # the GPU was checkpointed around the dump
    finally:
        tree = descendants(run.proc.pid)
        run.kill()
        wait_for(lambda: all(gone(p) for p in tree), 30, "the workload to die")


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None
