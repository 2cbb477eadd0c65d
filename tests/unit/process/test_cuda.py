"""The GPU checkpoint sequence around a dump, against a FAKE driver: no GPU or libcuda exists
on the machines that run this suite (the real driver is exercised by scripts/gpu_check.py on
a GPU host). The fake mimics the driver's state machine per PID."""

from __future__ import annotations

import ctypes

import pytest

from cairn.exceptions import NotSnapshottable
from cairn.process import cuda


class FakeLibcuda:
    """FAKE of libcuda's checkpoint entry points: RUNNING -> LOCKED -> CHECKPOINTED and back."""

    def __init__(self, pids: list[int], *, unsupported: set[int] = frozenset()) -> None:
        self.states = {p: cuda.ProcessState.RUNNING for p in pids}
        self.unsupported = unsupported
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: list[int] = []

    def cuInit(self, flags: int) -> int:  # noqa: N802 - the driver's names
        return 0

    def cuGetErrorString(self, code: int, out: object) -> int:  # noqa: N802
        out._obj.value = b"CUDA_ERROR_NOT_SUPPORTED" if code == 801 else b"CUDA_ERROR_ILLEGAL_STATE"
        return 0

    def cuCheckpointProcessGetState(self, pid: int, out: object) -> int:  # noqa: N802
        if pid not in self.states:
            return 1
        out._obj.value = int(self.states[pid])
        return 0

    def _move(self, name: str, pid: int, frm: cuda.ProcessState, to: cuda.ProcessState) -> int:
        self.calls.append((name, pid))
        if pid in self.unsupported:
            return 801
        if self.states.get(pid) is not frm:
            return 401
        self.states[pid] = to
        return 0

    def cuCheckpointProcessLock(self, pid: int, args: ctypes.Array) -> int:  # noqa: N802
        self.lock_timeouts.append(args[0])
        return self._move("lock", pid, cuda.ProcessState.RUNNING, cuda.ProcessState.LOCKED)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: object) -> int:  # noqa: N802
        return self._move("checkpoint", pid, cuda.ProcessState.LOCKED,
                          cuda.ProcessState.CHECKPOINTED)

    def cuCheckpointProcessRestore(self, pid: int, args: object) -> int:  # noqa: N802
        return self._move("restore", pid, cuda.ProcessState.CHECKPOINTED,
                          cuda.ProcessState.LOCKED)

    def cuCheckpointProcessUnlock(self, pid: int, args: object) -> int:  # noqa: N802
        return self._move("unlock", pid, cuda.ProcessState.LOCKED, cuda.ProcessState.RUNNING)


def test_dump_with_leave_running_gives_the_gpu_back_in_order() -> None:
    lib = FakeLibcuda([10, 11])
    api = cuda.CudaCheckpoint(lib)
    assert cuda.cuda_pids(api, [10, 11, 12]) == [10, 11]
    with cuda.suspended(api, [10, 11], resume=True):
        assert all(s is cuda.ProcessState.CHECKPOINTED for s in lib.states.values())
    assert [c for c, _ in lib.calls] == ["lock", "lock", "checkpoint", "checkpoint", "restore",
                                         "restore", "unlock", "unlock"]
    assert all(s is cuda.ProcessState.RUNNING for s in lib.states.values())
    assert lib.lock_timeouts == [cuda.DEFAULT_LOCK_TIMEOUT_MS] * 2


def test_a_failed_dump_still_gives_the_gpu_back() -> None:
    lib = FakeLibcuda([10])
    api = cuda.CudaCheckpoint(lib)
    with pytest.raises(RuntimeError), cuda.suspended(api, [10], resume=True):
        raise RuntimeError("criu dump failed")
    assert lib.states[10] is cuda.ProcessState.RUNNING


def test_final_dump_leaves_it_checkpointed_and_restore_resumes() -> None:
    lib = FakeLibcuda([10])
    api = cuda.CudaCheckpoint(lib)
    with cuda.suspended(api, [10], resume=False):
        pass
    assert lib.states[10] is cuda.ProcessState.CHECKPOINTED
    cuda.resume_restored(api, [10])
    assert lib.states[10] is cuda.ProcessState.RUNNING


def test_uvm_or_ipc_is_refused_clearly_and_the_others_are_released() -> None:
    lib = FakeLibcuda([10, 11], unsupported={11})
    api = cuda.CudaCheckpoint(lib)
    with pytest.raises(NotSnapshottable, match="UVM/managed memory and CUDA IPC"):
        with cuda.suspended(api, [10, 11], resume=True):
            pass
    assert lib.states[10] is cuda.ProcessState.RUNNING


def test_host_ram_must_hold_the_device_copy() -> None:
    cuda.check_fits(8 << 30, available=16 << 30)
    with pytest.raises(NotSnapshottable, match="resources.limits.memory"):
        cuda.check_fits(80 << 30, available=16 << 30)


def test_an_old_driver_is_named() -> None:
    class OldDriver:
        def cuInit(self, flags: int) -> int:  # noqa: N802
            return 0

    with pytest.raises(cuda.GpuCheckpointError, match="driver 570"):
        cuda.CudaCheckpoint(OldDriver())  # type: ignore[arg-type]


def test_no_driver_here_means_none() -> None:
    # This suite's machines have no NVIDIA driver; where one exists this is not None.
    try:
        ctypes.CDLL(cuda.LIBCUDA)
    except OSError:
        assert cuda.CudaCheckpoint.load() is None
    else:
        pytest.skip("an NVIDIA driver is installed here")
