"""GPU state around a CRIU dump, through the CUDA driver's checkpoint API (driver >= 570).

``cuCheckpointProcessLock`` stops a process's CUDA work, ``cuCheckpointProcessCheckpoint``
copies its device memory into its own host memory and releases the GPU, so plain CRIU can dump
it; ``cuCheckpointProcessRestore`` puts the memory back on a GPU and
``cuCheckpointProcessUnlock`` lets it run. cairn calls the driver itself (ctypes on
``libcuda.so.1``) rather than through CRIU's ``cuda_plugin``, which shells out to NVIDIA's
``cuda-checkpoint`` binary that a training image rarely has (ADR 0009).

Limits from the driver: UVM (managed) memory and CUDA IPC are not supported, the copy needs
host RAM for all device memory in use, and if a checkpoint fails midway the process may be
left unusable (on CPU a failed dump leaves the process unharmed).

Only the supervisor's main thread calls this module.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Iterator
from contextlib import contextmanager

from cairn.exceptions import NotSnapshottable, ProcessError

LIBCUDA = "libcuda.so.1"
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_NOT_INITIALIZED = 3
DEFAULT_LOCK_TIMEOUT_MS = 60_000
_ARGS_BYTES = 64  # every CUcheckpoint*Args struct is 64 bytes, zeroed when unused


class ProcessState(enum.IntEnum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class GpuCheckpointError(ProcessError):
    """A CUDA checkpoint call failed; the message names the call and the driver's error."""


class CudaCheckpoint:
    """The driver's checkpoint calls for other processes (by PID)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name in ("cuCheckpointProcessGetState", "cuCheckpointProcessLock",
                     "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                     "cuCheckpointProcessUnlock"):
            if not hasattr(lib, name):
                raise GpuCheckpointError(f"the NVIDIA driver has no {name}: GPU process snapshots "
                                         "need driver 570 or newer")
        self._check("cuInit", lib.cuInit(0))

    @classmethod
    def load(cls) -> CudaCheckpoint | None:
        """The API, or None where there is no NVIDIA driver."""
        try:
            lib = ctypes.CDLL(LIBCUDA)
        except OSError:
            return None
        return cls(lib)

    def _error_text(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self._lib.cuGetErrorString(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            return f"{text.value.decode(errors='replace')} ({code})"
        return f"CUDA error {code}"

    def _check(self, call: str, code: int, pid: int | None = None) -> None:
        if code == CUDA_SUCCESS:
            return
        where = f" for pid {pid}" if pid is not None else ""
        if code == CUDA_ERROR_NOT_SUPPORTED:
            raise NotSnapshottable(
                f"{call}{where}: the driver cannot checkpoint this process "
                f"({self._error_text(code)}); UVM/managed memory and CUDA IPC are not supported. "
                "Use state mode (cairn.Checkpointer) for this workload")
        raise GpuCheckpointError(f"{call}{where} failed: {self._error_text(code)}")

    def state(self, pid: int) -> ProcessState | None:
        """The process's CUDA state, or None when it has no CUDA context."""
        value = ctypes.c_int()
        code = self._lib.cuCheckpointProcessGetState(pid, ctypes.byref(value))
        if code != CUDA_SUCCESS:
            return None
        return ProcessState(value.value)

    def lock(self, pid: int, *, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
        args = (ctypes.c_uint32 * (_ARGS_BYTES // 4))()
        args[0] = timeout_ms  # CUcheckpointLockArgs.timeoutMs comes first
        self._check("cuCheckpointProcessLock", self._lib.cuCheckpointProcessLock(pid, args), pid)

    def checkpoint(self, pid: int) -> None:
        self._check("cuCheckpointProcessCheckpoint",
                    self._lib.cuCheckpointProcessCheckpoint(pid, _zeroed()), pid)

    def restore(self, pid: int) -> None:
        self._check("cuCheckpointProcessRestore",
                    self._lib.cuCheckpointProcessRestore(pid, _zeroed()), pid)

    def unlock(self, pid: int) -> None:
        self._check("cuCheckpointProcessUnlock",
                    self._lib.cuCheckpointProcessUnlock(pid, _zeroed()), pid)


def _zeroed() -> ctypes.Array[ctypes.c_uint64]:
    return (ctypes.c_uint64 * (_ARGS_BYTES // 8))()


def cuda_pids(api: CudaCheckpoint, pids: list[int]) -> list[int]:
    """The processes among ``pids`` that hold a CUDA context (running or locked)."""
    return [p for p in pids if api.state(p) is not None]


def host_memory_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check_fits(gpu_bytes: int, *, available: int | None = None) -> None:
    """The driver copies device memory into host RAM: refuse a checkpoint that cannot fit."""
    available = host_memory_available() if available is None else available
    if gpu_bytes > available:
        raise NotSnapshottable(
            f"the workload holds {gpu_bytes / 2**30:.1f} GiB of GPU memory and only "
            f"{available / 2**30:.1f} GiB of host RAM is available for the checkpoint copy; give "
            "the pod more memory (resources.limits.memory) or use state mode")


@contextmanager
def suspended(api: CudaCheckpoint, pids: list[int], *, resume: bool) -> Iterator[None]:
    """Lock and checkpoint every CUDA process in ``pids`` (device memory moves into host
    memory), then run the body (the CRIU dump). With ``resume``, restore and unlock them
    afterwards, also when the body failed."""
    locked: list[int] = []
    checkpointed: list[int] = []
    try:
        for pid in pids:
            api.lock(pid)
            locked.append(pid)
        for pid in pids:
            api.checkpoint(pid)
            checkpointed.append(pid)
        yield
    finally:
        if resume or len(checkpointed) < len(pids):
            errors = []
            for pid in checkpointed:
                try:
                    api.restore(pid)
                except ProcessError as e:
                    errors.append(str(e))
            for pid in locked:
                try:
                    api.unlock(pid)
                except ProcessError as e:
                    errors.append(str(e))
            if errors:
                raise GpuCheckpointError("the GPU state could not be given back after the dump; "
                                         "the workload may be unusable: " + "; ".join(errors))


def resume_restored(api: CudaCheckpoint, pids: list[int]) -> None:
    """After ``criu restore``: put device memory back on the GPU and let the processes run."""
    for pid in pids:
        if api.state(pid) is ProcessState.CHECKPOINTED:
            api.restore(pid)
    for pid in pids:
        if api.state(pid) is ProcessState.LOCKED:
            api.unlock(pid)


def gpu_memory_in_use() -> int:
    """Bytes of device memory in use on every GPU (an upper bound for one workload: inside a
    container NVML reports host PIDs, so per-process figures cannot be matched)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        done = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    total = 0
    for line in done.stdout.splitlines():
        try:
            total += int(float(line.strip())) << 20
        except ValueError:
            continue
    return total


__all__ = ["CudaCheckpoint", "GpuCheckpointError", "ProcessState", "check_fits", "cuda_pids",
           "gpu_memory_in_use", "resume_restored", "suspended"]
