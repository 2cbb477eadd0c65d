"""The GPU checkpoint calls through cairn's real ctypes path, against the FAKE driver
(native/fakecuda, ``make fakecuda``): no GPU or libcuda exists on the machines that run this
suite. The fake keeps the driver's per-process state machine in files shared with the
workload processes that register with it, enforces its documented rules and records the
arguments it received, so a wrong struct layout, call order, remap pair or lock timeout
fails here."""

from __future__ import annotations

import ctypes
import shutil
import time
from pathlib import Path

import pytest

from cairn.exceptions import NotSnapshottable, ProcessError
from cairn.process import cuda
from tests.support.fakecuda import (A100, GIB, UUID_A, UUID_B, UUID_C, FakeDriver, Gpu,
                                    fake_driver, pairs_received, set_env, workloads)

__all__ = ["fake_driver", "workloads"]  # fixtures


@pytest.fixture()
def api(fake_driver: FakeDriver) -> cuda.CudaCheckpoint:
    loaded = cuda.CudaCheckpoint.load()
    assert loaded is not None
    return loaded


def test_struct_layouts_are_cuda_13_0s() -> None:
    assert [ctypes.sizeof(s) for s in (cuda.LockArgs, cuda.CheckpointArgs, cuda.RestoreArgs,
                                       cuda.UnlockArgs)] == [64, 64, 64, 64]
    assert cuda.RestoreArgs.gpuPairs.offset == 0
    assert cuda.RestoreArgs.gpuPairsCount.offset == 8
    assert cuda.RestoreArgs.reserved1.offset == 56
    assert ctypes.sizeof(cuda.GpuPair) == 32 and cuda.GpuPair.newUuid.offset == 16
    assert cuda.uuid_bytes(UUID_A) == bytes.fromhex("aaaaaaaa000011112222333333333333")


def test_dump_with_leave_running_gives_the_gpu_back_in_order(api, fake_driver, workloads) -> None:
    one, two = workloads({UUID_A: GIB}), workloads({UUID_A: 2 * GIB})
    assert cuda.cuda_pids(api, [one.pid, two.pid, 1]) == [one.pid, two.pid]
    with cuda.suspended(api, [one.pid, two.pid], resume=True, lock_timeout_ms=2500) as stall:
        assert fake_driver.state(one.pid) == fake_driver.state(two.pid) == 2  # CHECKPOINTED
    moves = [(c["call"].removeprefix("cuCheckpointProcess"), c["pid"], c["rc"])
             for c in fake_driver.calls("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                                        "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")]
    assert moves == [("Lock", one.pid, 0), ("Lock", two.pid, 0), ("Checkpoint", one.pid, 0),
                     ("Checkpoint", two.pid, 0), ("Restore", one.pid, 0),
                     ("Restore", two.pid, 0), ("Unlock", one.pid, 0), ("Unlock", two.pid, 0)]
    assert [c["timeout_ms"] for c in fake_driver.calls("cuCheckpointProcessLock")] == [2500, 2500]
    assert pairs_received(fake_driver) == [[], []]  # same GPUs: no remap asked for
    assert fake_driver.state(one.pid) == fake_driver.state(two.pid) == 0  # RUNNING
    assert stall.total_s >= stall.lock_s + stall.checkpoint_s > 0


def test_the_lock_timeout_comes_from_the_time_left() -> None:
    assert cuda.lock_timeout_ms(4.0) == 2000
    assert cuda.lock_timeout_ms(3600.0) == cuda.DEFAULT_LOCK_TIMEOUT_MS
    assert cuda.lock_timeout_ms(0.0) == 1  # never 0, which the driver reads as no timeout
    assert cuda.lock_timeout_ms(None) == cuda.DEFAULT_LOCK_TIMEOUT_MS


def test_final_dump_leaves_it_checkpointed_and_restore_remaps(api, fake_driver, workloads,
                                                              monkeypatch) -> None:
    w = workloads({UUID_A: GIB})
    with cuda.suspended(api, [w.pid], resume=False, lock_timeout_ms=1000):
        pass
    assert fake_driver.state(w.pid) == 2
    # The retry's node: another GPU of the same model.
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_B)))
    cuda.resume_restored(api, [w.pid], pairs=[(UUID_A, UUID_B)])
    assert pairs_received(fake_driver) == [[[UUID_A, UUID_B]]]
    assert fake_driver.state(w.pid) == 0
    assert fake_driver.gpus_of(w.pid) == [UUID_B]


def _checkpointed(api: cuda.CudaCheckpoint, w) -> None:
    with cuda.suspended(api, [w.pid], resume=False, lock_timeout_ms=1000):
        pass


@pytest.mark.parametrize(("gpus", "pairs", "why"), [
    ([Gpu(UUID_B)], [], "the snapshot's GPU is not here"),
    ([Gpu(UUID_B), Gpu(UUID_C)], [(UUID_C, UUID_B)], "its GPU not listed in the pairs"),
    ([Gpu(UUID_B)], [(UUID_A, UUID_C)], "the target GPU is not here"),
    ([Gpu(UUID_B, name=A100)], [(UUID_A, UUID_B)], "another chip"),
    ([Gpu(UUID_B, used=79 * GIB)], [(UUID_A, UUID_B)], "too little free memory"),
])
def test_the_fake_refuses_what_the_driver_refuses(api, fake_driver, workloads, monkeypatch,
                                                  gpus, pairs, why) -> None:
    w = workloads({UUID_A: 2 * GIB})
    _checkpointed(api, w)
    set_env(monkeypatch, fake_driver.gpus(*gpus))
    with pytest.raises(cuda.GpuRestoreRefused, match="refused to restore onto these GPUs"):
        api.restore(w.pid, pairs=pairs)
    assert fake_driver.state(w.pid) == 2, why  # still checkpointed: nothing half done


def test_a_driver_older_than_580_cannot_remap(fake_driver, workloads, monkeypatch) -> None:
    monkeypatch.setenv("FAKECUDA_DRIVER", "570.133.20")
    api = cuda.CudaCheckpoint.load()
    assert api is not None and api.cuda_version == 12080 and not api.can_remap
    w = workloads({UUID_A: GIB})
    _checkpointed(api, w)
    with pytest.raises(cuda.GpuRestoreRefused, match="needs driver 580"):
        api.restore(w.pid, pairs=[(UUID_A, UUID_B)])
    assert fake_driver.calls("cuCheckpointProcessRestore") == []  # refused before the call
    api.restore(w.pid)  # the same GPU, no pairs: fine on 570
    assert fake_driver.state(w.pid) == 1


def test_illegal_transitions_are_state_errors(api, fake_driver, workloads) -> None:
    w = workloads({UUID_A: GIB})
    with pytest.raises(cuda.GpuStateError, match="CUDA_ERROR_ILLEGAL_STATE"):
        api.unlock(w.pid)  # RUNNING -> RUNNING
    with pytest.raises(cuda.GpuStateError):
        api.checkpoint(w.pid)  # not locked
    api.lock(w.pid, timeout_ms=100)
    with pytest.raises(cuda.GpuStateError):
        api.restore(w.pid)  # locked, not checkpointed
    assert fake_driver.state(w.pid) == 1
    assert [c["rc"] for c in fake_driver.calls()[-4:]] == [401, 401, 0, 401]


def test_an_unknown_state_is_a_clear_error(api, fake_driver, workloads) -> None:
    w = workloads({UUID_A: GIB})
    path = fake_driver.state_dir / str(w.pid)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([f"7 {lines[0].split()[1]}", *lines[1:]]) + "\n")
    with pytest.raises(cuda.GpuStateError, match="unknown state 7"):
        api.state(w.pid)


def test_nothing_before_cuinit_and_reserved_bytes_must_be_zero(fake_driver, workloads,
                                                                 tmp_path: Path) -> None:
    w = workloads({UUID_A: GIB})
    copy = tmp_path / "libfakecuda-copy.so"  # a second instance, not yet initialized
    shutil.copy(fake_driver.library, copy)
    lib = ctypes.CDLL(str(copy))
    state = ctypes.c_int()
    assert lib.cuCheckpointProcessGetState(w.pid, ctypes.byref(state)) == 3  # NOT_INITIALIZED
    assert lib.cuInit(0) == 0
    assert lib.cuCheckpointProcessGetState(w.pid, ctypes.byref(state)) == 0
    dirty = cuda.LockArgs(timeoutMs=100, reserved0=1)
    assert lib.cuCheckpointProcessLock(w.pid, ctypes.byref(dirty)) == 1  # INVALID_VALUE
    assert fake_driver.state(w.pid) == 0


def test_a_lock_that_cannot_finish_times_out_inside_its_timeout(api, fake_driver, workloads,
                                                                monkeypatch) -> None:
    w = workloads({UUID_A: GIB})
    monkeypatch.setenv("FAKECUDA_HANG", "cuCheckpointProcessLock")
    started = time.monotonic()
    with pytest.raises(cuda.GpuLockTimeout, match="did not stop within 200 ms"):
        with cuda.suspended(api, [w.pid], resume=True, lock_timeout_ms=200):
            pass
    assert time.monotonic() - started < 5
    assert fake_driver.state(w.pid) == 0  # never locked, left running


def test_a_failed_checkpoint_reports_the_workload_unusable(api, fake_driver, workloads,
                                                           monkeypatch) -> None:
    w = workloads({UUID_A: GIB})
    monkeypatch.setenv("FAKECUDA_FAIL", "cuCheckpointProcessCheckpoint=999")
    with pytest.raises(cuda.GpuCheckpointError, match="may be unusable"):
        with cuda.suspended(api, [w.pid], resume=True, lock_timeout_ms=1000):
            pass
    assert fake_driver.state(w.pid) == 3  # FAILED, as the driver may leave it


def test_a_failed_dump_still_gives_the_gpu_back(api, fake_driver, workloads) -> None:
    w = workloads({UUID_A: GIB})
    with pytest.raises(RuntimeError), cuda.suspended(api, [w.pid], resume=True,
                                                     lock_timeout_ms=1000):
        raise RuntimeError("criu dump failed")
    assert fake_driver.state(w.pid) == 0


def test_uvm_or_ipc_is_refused_clearly_and_the_others_are_released(api, fake_driver, workloads,
                                                                   monkeypatch) -> None:
    one, two = workloads({UUID_A: GIB}), workloads({UUID_A: GIB})
    monkeypatch.setenv("FAKECUDA_FAIL", "cuCheckpointProcessCheckpoint=801")
    with pytest.raises(NotSnapshottable, match="UVM/managed memory and CUDA IPC"):
        with cuda.suspended(api, [one.pid, two.pid], resume=True, lock_timeout_ms=1000):
            pass
    assert fake_driver.state(two.pid) == 0  # locked, then unlocked again


def test_host_ram_must_hold_the_device_copy() -> None:
    cuda.check_fits(8 << 30, available=16 << 30)
    with pytest.raises(NotSnapshottable, match="resources.limits.memory"):
        cuda.check_fits(80 << 30, available=16 << 30)
    with pytest.raises(NotSnapshottable, match="its GPUs hold 80.0 GiB .*device-wide figure"):
        cuda.check_fits(80 << 30, available=16 << 30, device_wide=True)


def test_an_old_driver_is_named() -> None:
    class OldDriver:
        """FAKE: a driver before 570, without the checkpoint calls."""

    with pytest.raises(cuda.GpuCheckpointError, match="driver 570"):
        cuda.CudaCheckpoint(OldDriver())  # type: ignore[arg-type]


def test_no_driver_means_none(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CAIRN_CUDA_LIBRARY", str(tmp_path / "no-libcuda.so.1"))
    assert cuda.CudaCheckpoint.load() is None


def test_errors_are_cairn_process_errors() -> None:
    for cls in (cuda.GpuStateError, cuda.GpuLockTimeout, cuda.GpuRestoreRefused):
        assert issubclass(cls, ProcessError) and not issubclass(cls, ValueError)


def test_the_restore_thread_id_is_answered_for_a_registered_process(api, fake_driver,
                                                                    workloads) -> None:
    w = workloads({UUID_A: GIB})
    lib = ctypes.CDLL(str(fake_driver.library))  # the instance cairn initialized
    tid = ctypes.c_int()
    assert lib.cuCheckpointProcessGetRestoreThreadId(w.pid, ctypes.byref(tid)) == 0
    assert tid.value == w.pid  # the fake has no thread of its own in the workload
    assert lib.cuCheckpointProcessGetRestoreThreadId(1 << 22, ctypes.byref(tid)) == 500


@pytest.mark.parametrize("call", ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                                  "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"])
@pytest.mark.parametrize(("code", "error", "named"), [
    (401, cuda.GpuStateError, "CUDA_ERROR_ILLEGAL_STATE"),
    (600, cuda.GpuCheckpointError, "CUDA_ERROR_NOT_READY"),
    (909, cuda.GpuCheckpointError, "CUDA_ERROR_TIMEOUT"),
    (999, cuda.GpuCheckpointError, "unknown error (CUDA_ERROR_UNKNOWN)"),
    (12345, cuda.GpuCheckpointError, "CUDA error 12345"),  # no name in cuda.h, nor the fake's
])
def test_every_driver_error_is_a_clear_cairn_error(api, fake_driver, workloads, monkeypatch,
                                                   call, code, error, named) -> None:
    w = workloads({UUID_A: GIB})
    if call != "cuCheckpointProcessLock":
        api.lock(w.pid, timeout_ms=1000)
    if call == "cuCheckpointProcessRestore":
        api.checkpoint(w.pid)
    monkeypatch.setenv("FAKECUDA_FAIL", f"{call}={code}")
    step = {"cuCheckpointProcessLock": lambda: api.lock(w.pid, timeout_ms=1000),
            "cuCheckpointProcessCheckpoint": lambda: api.checkpoint(w.pid),
            "cuCheckpointProcessRestore": lambda: api.restore(w.pid),
            "cuCheckpointProcessUnlock": lambda: api.unlock(w.pid)}[call]
    with pytest.raises(error) as caught:
        step()
    assert not isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert message.startswith(call) and f"pid {w.pid}" in message and named in message
    assert caught.value.code == code
    if call == "cuCheckpointProcessLock" and code in (600, 909):
        assert isinstance(caught.value, cuda.GpuLockTimeout)  # the two a lock may time out with
        assert "did not stop within 1000 ms" in message
    elif call == "cuCheckpointProcessRestore" and code != 401:
        assert type(caught.value) is cuda.GpuCheckpointError  # not taken for a refused remap

