"""GPU state around a CRIU dump, through the CUDA driver's checkpoint API (driver >= 570).

``cuCheckpointProcessLock`` stops a process's CUDA work, ``cuCheckpointProcessCheckpoint``
copies its device memory into its own host memory and releases the GPU, so plain CRIU can dump
it; ``cuCheckpointProcessRestore`` puts the memory back on a GPU and
``cuCheckpointProcessUnlock`` lets it run. cairn calls the driver itself (ctypes on
``libcuda.so.1``, or the library ``CAIRN_CUDA_LIBRARY`` names: the tests' fake) rather than through CRIU's ``cuda_plugin``, which shells out to NVIDIA's
``cuda-checkpoint`` binary that a training image rarely has (ADR 0009).

Limits from the driver: UVM (managed) memory and CUDA IPC are not supported, the copy needs
host RAM (within the pod's memory limit) for the device memory the workload holds, and if a checkpoint fails midway the process may be
left unusable (on CPU a failed dump leaves the process unharmed).

Only the supervisor's main thread calls this module.
"""

from __future__ import annotations

import ctypes
import enum
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from cairn.exceptions import NotSnapshottable, ProcessError
from cairn.process import doctor  # the meminfo and cgroup readers
from cairn.process.gpu_refusals import STATE_MODE_FIX
from cairn.runtime.env import CUDA_LIBRARY

LIBCUDA = CUDA_LIBRARY.default or "libcuda.so.1"
CUDA_SUCCESS = 0
DEFAULT_LOCK_TIMEOUT_MS = 60_000  # the most a lock may wait, whatever the budget
LOCK_SHARE = 0.5  # of a dump's time left: the copy and CRIU's dump need the rest
REMAP_MIN_CUDA_VERSION = 13000  # cuDriverGetVersion of driver r580, the first with gpuPairs


class CudaError(enum.IntEnum):
    """The ``CUresult`` codes (cuda.h) the checkpoint calls are documented or seen to return."""

    INVALID_VALUE = 1
    OUT_OF_MEMORY = 2
    NOT_INITIALIZED = 3
    NO_DEVICE = 100
    INVALID_DEVICE = 101
    ILLEGAL_STATE = 401
    NOT_FOUND = 500
    NOT_READY = 600
    NOT_SUPPORTED = 801
    TIMEOUT = 909
    UNKNOWN = 999


class ProcessState(enum.IntEnum):
    """``CUprocessState``."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


# The argument structs, as CUDA 13.0's cuda.h lays them out (64 bytes each, reserved bytes
# zeroed). Later headers reuse reserved bytes without moving these fields.
class LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
                ("reserved1", ctypes.c_uint64)]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


for _struct in (LockArgs, CheckpointArgs, RestoreArgs, UnlockArgs):
    assert ctypes.sizeof(_struct) == 64, _struct
assert ctypes.sizeof(GpuPair) == 32 and RestoreArgs.gpuPairsCount.offset == 8


class GpuCheckpointError(ProcessError):
    """A CUDA checkpoint call failed; the message names the call and the driver's error."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class GpuStateError(GpuCheckpointError):
    """The driver refused a call in the process's present state (``ILLEGAL_STATE``), or
    reported a state cairn does not know."""


class GpuLockTimeout(GpuCheckpointError):
    """The lock did not get the process's CUDA work quiet within its timeout."""


class GpuRestoreRefused(GpuCheckpointError):
    """The driver would not put the device memory back on the GPUs it was asked to."""


def uuid_bytes(uuid: str) -> bytes:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (NVML's form) -> the 16 bytes of CUuuid."""
    text = uuid.removeprefix("GPU-").replace("-", "")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise ProcessError(f"not a GPU UUID: {uuid!r} (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-"
                           "xxxxxxxxxxxx, as nvidia-smi -L shows)")
    return raw


def lock_timeout_ms(time_left_s: float | None) -> int:
    """The lock's timeout: :data:`LOCK_SHARE` of the dump's time left, at most
    :data:`DEFAULT_LOCK_TIMEOUT_MS`, at least 1 ms (0 would mean no timeout)."""
    if time_left_s is None:
        return DEFAULT_LOCK_TIMEOUT_MS
    return max(1, min(DEFAULT_LOCK_TIMEOUT_MS, int(time_left_s * LOCK_SHARE * 1000)))


_CALLS = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock",
          "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
          "cuCheckpointProcessUnlock")


class CudaCheckpoint:
    """The driver's checkpoint calls for other processes (by PID)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name in _CALLS:
            if not hasattr(lib, name):
                raise GpuCheckpointError(f"the NVIDIA driver has no {name}: GPU process snapshots "
                                         "need driver 570 or newer")
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuCheckpointProcessGetState.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        for name, args in (("cuCheckpointProcessLock", LockArgs),
                           ("cuCheckpointProcessCheckpoint", CheckpointArgs),
                           ("cuCheckpointProcessRestore", RestoreArgs),
                           ("cuCheckpointProcessUnlock", UnlockArgs)):
            getattr(lib, name).argtypes = [ctypes.c_int, ctypes.POINTER(args)]
        for name in ("cuInit", "cuGetErrorString", "cuDriverGetVersion", *_CALLS):
            if hasattr(lib, name):
                getattr(lib, name).restype = ctypes.c_int
        self._check("cuInit", lib.cuInit(0))
        version = ctypes.c_int()
        self.cuda_version = (version.value if hasattr(lib, "cuDriverGetVersion")
                             and lib.cuDriverGetVersion(ctypes.byref(version)) == CUDA_SUCCESS
                             else 0)

    @classmethod
    def load(cls, *, environ: Mapping[str, str] | None = None) -> CudaCheckpoint | None:
        """The API from ``CAIRN_CUDA_LIBRARY`` (default ``libcuda.so.1``), or None where that
        library does not load (no NVIDIA driver here)."""
        try:
            lib = ctypes.CDLL(CUDA_LIBRARY.get(environ) or LIBCUDA)
        except OSError:
            return None
        return cls(lib)

    @property
    def can_remap(self) -> bool:
        """Whether a restore may name other GPUs (``gpuPairs``): driver >= 580."""
        return self.cuda_version >= REMAP_MIN_CUDA_VERSION

    def _error_text(self, code: int) -> str:
        name = (f"CUDA_ERROR_{CudaError(code).name}" if code in CudaError._value2member_map_
                else f"CUDA error {code}")
        text = ctypes.c_char_p()
        if self._lib.cuGetErrorString(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            return f"{text.value.decode(errors='replace')} ({name})"
        return name

    def _check(self, call: str, code: int, pid: int | None = None, *,
               timeout_ms: int | None = None) -> None:
        if code == CUDA_SUCCESS:
            return
        where = f" for pid {pid}" if pid is not None else ""
        text = self._error_text(code)
        if code == CudaError.NOT_SUPPORTED:
            raise NotSnapshottable(
                f"{call}{where}: the driver cannot checkpoint this process ({text}); "
                f"UVM/managed memory and CUDA IPC are not supported; {STATE_MODE_FIX}")
        if call == "cuCheckpointProcessLock" and code in (CudaError.NOT_READY, CudaError.TIMEOUT):
            raise GpuLockTimeout(
                f"{call}{where}: the process's CUDA work did not stop within {timeout_ms} ms "
                f"({text}); the snapshot is skipped and the workload keeps running", code=code)
        if code == CudaError.ILLEGAL_STATE:
            raise GpuStateError(f"{call}{where}: not allowed in the process's present CUDA state "
                                f"({text})", code=code)
        if call == "cuCheckpointProcessRestore" and code in (
                CudaError.INVALID_DEVICE, CudaError.OUT_OF_MEMORY, CudaError.INVALID_VALUE,
                CudaError.NO_DEVICE):
            raise GpuRestoreRefused(f"{call}{where}: the driver refused to restore onto these "
                                    f"GPUs ({text}): a GPU missing, of another model, without "
                                    "the memory, or a remap this driver cannot do", code=code)
        if code == CudaError.NOT_INITIALIZED:
            raise GpuCheckpointError(f"{call}{where} failed: the driver is not initialized "
                                     f"({text})", code=code)
        raise GpuCheckpointError(f"{call}{where} failed: {text}", code=code)

    def state(self, pid: int) -> ProcessState | None:
        """The process's CUDA state, or None when it has no CUDA context. A state value this
        module does not know raises :class:`GpuStateError`."""
        value = ctypes.c_int()
        code = self._lib.cuCheckpointProcessGetState(pid, ctypes.byref(value))
        if code != CUDA_SUCCESS:
            return None
        try:
            return ProcessState(value.value)
        except ValueError:
            raise GpuStateError(f"cuCheckpointProcessGetState for pid {pid}: unknown state "
                                f"{value.value} (a driver newer than cairn knows?)") from None

    def lock(self, pid: int, *, timeout_ms: int) -> None:
        """Stop the process's CUDA work; waits at most ``timeout_ms`` (>= 1)."""
        if timeout_ms < 1:
            raise ValueError("a lock timeout of 0 would wait forever")
        args = LockArgs(timeoutMs=timeout_ms)
        self._check("cuCheckpointProcessLock",
                    self._lib.cuCheckpointProcessLock(pid, ctypes.byref(args)), pid,
                    timeout_ms=timeout_ms)

    def checkpoint(self, pid: int) -> None:
        args = CheckpointArgs()
        self._check("cuCheckpointProcessCheckpoint",
                    self._lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)), pid)

    def restore(self, pid: int, *, pairs: Sequence[tuple[str, str]] = ()) -> None:
        """Put device memory back on a GPU; ``pairs`` (old UUID, new UUID) remap the process
        onto other GPUs and must name every GPU it was checkpointed on (driver >= 580)."""
        args = RestoreArgs()
        if pairs:
            if not self.can_remap:
                raise GpuRestoreRefused("cuCheckpointProcessRestore: this driver (CUDA "
                                        f"{self.cuda_version}) cannot restore onto other GPUs; "
                                        "that needs driver 580 or newer")
            array = (GpuPair * len(pairs))()
            for i, (old, new) in enumerate(pairs):
                array[i].oldUuid[:] = uuid_bytes(old)
                array[i].newUuid[:] = uuid_bytes(new)
            args.gpuPairs = array  # ctypes keeps the array alive as long as args
            args.gpuPairsCount = len(pairs)
        self._check("cuCheckpointProcessRestore",
                    self._lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)), pid)

    def unlock(self, pid: int) -> None:
        args = UnlockArgs()
        self._check("cuCheckpointProcessUnlock",
                    self._lib.cuCheckpointProcessUnlock(pid, ctypes.byref(args)), pid)


def cuda_pids(api: CudaCheckpoint, pids: list[int]) -> list[int]:
    """The processes among ``pids`` that hold a CUDA context (running or locked)."""
    return [p for p in pids if api.state(p) is not None]


def host_memory_available() -> int:
    """Host RAM a checkpoint copy may take: MemAvailable, or less when the memory cgroup's
    limit leaves less headroom (a pod is killed at its limit, not when the host runs out)."""
    info = doctor.parse_meminfo(doctor.read_text("/proc/meminfo") or "")
    available = info.get("MemAvailable", 0)
    cgroup = doctor.cgroup_memory()
    if cgroup is not None and cgroup.headroom_bytes is not None:
        available = min(available, cgroup.headroom_bytes)
    return available


def check_fits(gpu_bytes: int, *, available: int | None = None,
               device_wide: bool = False) -> None:
    """The driver copies device memory into host RAM: refuse a checkpoint that cannot fit
    (``available`` defaults to :func:`host_memory_available`). ``device_wide``: the figure is
    the memory used on the workload's GPUs, not its own (its PIDs could not be matched)."""
    available = host_memory_available() if available is None else available
    if gpu_bytes > available:
        whose = ("its GPUs hold" if device_wide else "the workload holds")
        note = (" (the device-wide figure: NVML's PIDs do not match this PID namespace)"
                if device_wide else "")
        raise NotSnapshottable(
            f"{whose} {gpu_bytes / 2**30:.1f} GiB of GPU memory{note} and only "
            f"{available / 2**30:.1f} GiB of host RAM is available for the checkpoint copy; give "
            "the pod more memory (resources.limits.memory) or use state mode")


@dataclass
class GpuStall:
    """How long the GPU work was stopped: lock -> unlock (or -> the end of a final dump,
    which leaves it checkpointed). Seconds, filled in as the steps finish."""

    lock_s: float = 0.0
    checkpoint_s: float = 0.0
    total_s: float = 0.0


@contextmanager
def suspended(api: CudaCheckpoint, pids: list[int], *, resume: bool,
              lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
              stall: GpuStall | None = None) -> Iterator[GpuStall]:
    """Lock and checkpoint every CUDA process in ``pids`` (device memory moves into host
    memory), then run the body (the CRIU dump). With ``resume``, restore and unlock them
    afterwards, also when the body failed. Yields the :class:`GpuStall` (``stall`` when
    given), complete on exit, also an exit by an error."""
    locked: list[int] = []
    checkpointed: list[int] = []
    stall = GpuStall() if stall is None else stall
    started = time.monotonic()
    try:
        for pid in pids:
            api.lock(pid, timeout_ms=lock_timeout_ms)
            locked.append(pid)
        stall.lock_s = time.monotonic() - started
        for pid in pids:
            api.checkpoint(pid)
            checkpointed.append(pid)
        stall.checkpoint_s = time.monotonic() - started - stall.lock_s
        yield stall
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
            stall.total_s = time.monotonic() - started
            if errors:
                raise GpuCheckpointError("the GPU state could not be given back after the dump; "
                                         "the workload may be unusable: " + "; ".join(errors))
        stall.total_s = time.monotonic() - started


def resume_restored(api: CudaCheckpoint, pids: list[int], *,
                    pairs: Sequence[tuple[str, str]] = ()) -> None:
    """After ``criu restore``: put device memory back on the GPU (remapped by ``pairs``, old
    UUID -> new) and let the processes run."""
    for pid in pids:
        if api.state(pid) is ProcessState.CHECKPOINTED:
            api.restore(pid, pairs=pairs)
    for pid in pids:
        if api.state(pid) is ProcessState.LOCKED:
            api.unlock(pid)


__all__ = ["CudaCheckpoint", "CudaError", "GpuCheckpointError", "GpuLockTimeout",
           "GpuRestoreRefused", "GpuStall", "GpuStateError", "ProcessState", "check_fits",
           "cuda_pids", "host_memory_available", "lock_timeout_ms", "resume_restored", "suspended"]
