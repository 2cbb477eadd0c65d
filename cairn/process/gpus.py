"""This host's NVIDIA GPUs, from NVML (``pynvml``, the ``[gpu]`` extra), else ``nvidia-smi``.

:func:`inventory` never raises: a host without a driver has an inventory with no devices and
``source`` saying what was tried. NVML is loaded from ``CAIRN_NVML_LIBRARY`` (default
``libnvidia-ml.so.1``; the tests' fake driver serves it too).

NVML's MPS client list (``nvmlDeviceGetMPSComputeRunningProcesses``) is kept per GPU, for
the refusal of MPS clients before a dump (:mod:`cairn.process.gpu_refusals`).

Per-process GPU memory is matched to the workload's PIDs only where NVML reports PIDs of this
PID namespace. Inside a container it reports host PIDs, which match nothing: then the memory
used on the workload's GPUs, device-wide, stands in (Kubernetes allots whole GPUs, so that is
the pod's own), and :attr:`GpuUse.matched` says which it is.
"""

from __future__ import annotations

import ctypes
import enum
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cairn.runtime.env import NVML_LIBRARY

MIN_DRIVER = 570  # the checkpoint driver API
REMAP_DRIVER = 580  # cuCheckpointProcessRestore's gpuPairs


class Source(str, enum.Enum):
    NVML = "nvml"
    NVIDIA_SMI = "nvidia-smi"
    NONE = "none"


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as NVML reports it (bytes; ``compute_capability`` like ``"9.0"``)."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    compute_capability: str | None = None
    mig: bool = False


@dataclass(frozen=True)
class GpuUse:
    """Device memory a workload holds, per GPU UUID. ``matched``: from its own PIDs (else the
    whole memory used on the GPUs its processes were seen on, or on every visible GPU)."""

    per_gpu: Mapping[str, int]
    matched: bool

    @property
    def total(self) -> int:
        return sum(self.per_gpu.values())


@dataclass(frozen=True)
class Inventory:
    source: Source
    devices: tuple[GpuDevice, ...] = ()
    driver: str | None = None  # "580.65.06"
    cuda_driver: int | None = None  # cuDriverGetVersion's form: 13000 is CUDA 13.0
    processes: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # uuid -> pid -> B
    mps_clients: Mapping[str, frozenset[int]] = field(default_factory=dict)  # uuid -> pids
    note: str = ""  # why NVML was not used, or what failed

    @property
    def driver_major(self) -> int | None:
        try:
            return int((self.driver or "").split(".")[0])
        except ValueError:
            return None

    @property
    def can_remap(self) -> bool:
        """The driver restores a snapshot onto GPUs with other UUIDs (>= 580)."""
        return (self.driver_major or 0) >= REMAP_DRIVER

    def use_of(self, pids: Iterable[int]) -> GpuUse:
        """The memory ``pids`` hold on each GPU (see the module docstring)."""
        wanted = set(pids)
        matched: dict[str, int] = {}
        for uuid, by_pid in self.processes.items():
            own = sum(b for p, b in by_pid.items() if p in wanted)
            if own:
                matched[uuid] = own
        if matched:
            return GpuUse(matched, True)
        return GpuUse({d.uuid: d.memory_used for d in self.devices if d.memory_used}, False)


def visible(devices: Iterable[GpuDevice], environ: Mapping[str, str] | None = None
            ) -> tuple[GpuDevice, ...]:
    """The devices CUDA would show the workload, in its order: ``CUDA_VISIBLE_DEVICES``
    (indices or UUID prefixes) when set, else NVML's order. An entry that matches nothing
    ends the list, as CUDA does."""
    devices = tuple(devices)
    spec = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return devices
    out: list[GpuDevice] = []
    for entry in (e.strip() for e in spec.split(",")):
        found = None
        if entry.isdigit():
            found = next((d for d in devices if d.index == int(entry)), None)
        elif entry:
            found = next((d for d in devices if d.uuid.startswith(entry)), None)
        if found is None or found in out:
            break
        out.append(found)
    return tuple(out)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_inventory(library: str) -> Inventory:
    """Read the GPUs through pynvml with NVML loaded from ``library``. Raises ImportError
    (pynvml not installed), OSError (the library does not load) or pynvml.NVMLError."""
    import pynvml

    lib = ctypes.CDLL(library)
    if pynvml.nvmlLib is None or getattr(pynvml.nvmlLib, "_name", None) != lib._name:
        # pynvml loads "libnvidia-ml.so.1" itself and caches function pointers by name; hand
        # it the configured library instead, and forget pointers into another one.
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
    pynvml.nvmlInit()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda_driver: int | None = int(pynvml.nvmlSystemGetCudaDriverVersion())
        except pynvml.NVMLError:
            cuda_driver = None
        devices, processes, mps = [], {}, {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                cc: str | None = f"{major}.{minor}"
            except pynvml.NVMLError:
                cc = None
            try:
                mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:  # NOT_SUPPORTED on GPUs without MIG
                mig = False
            try:
                running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except pynvml.NVMLError:
                running = []
            processes[uuid] = {int(p.pid): int(p.usedGpuMemory or 0) for p in running}
            try:
                clients = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
            except pynvml.NVMLError:  # NOT_SUPPORTED, or a library without the call
                clients = []
            if clients:
                mps[uuid] = frozenset(int(p.pid) for p in clients)
            devices.append(GpuDevice(index, uuid, _text(pynvml.nvmlDeviceGetName(handle)),
                                     int(memory.total), int(memory.used), cc, mig))
    finally:
        pynvml.nvmlShutdown()
    return Inventory(Source.NVML, tuple(devices), driver, cuda_driver, processes, mps)


SMI_QUERY = ["--query-gpu=index,uuid,name,memory.total,memory.used,driver_version,"
             "compute_cap,mig.mode.current", "--format=csv,noheader,nounits"]


def parse_smi(text: str) -> tuple[tuple[GpuDevice, ...], str | None]:
    """``nvidia-smi`` with :data:`SMI_QUERY`: the devices and the driver version. Memory is
    in MiB there; a field of ``[N/A]`` reads as 0 / None."""
    devices, driver = [], None
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 8:
            continue
        # The name may hold commas: the fields after it are counted from the right.
        index, uuid, rest = parts[0], parts[1], parts[2:]
        name = ", ".join(rest[:-5])
        total, used, driver_text, cc, mig = rest[-5:]

        def mib(v: str) -> int:
            try:
                return int(float(v)) << 20
            except ValueError:
                return 0

        devices.append(GpuDevice(int(index), uuid, name, mib(total), mib(used),
                                 cc if cc[:1].isdigit() else None, mig == "Enabled"))
        driver = driver_text or driver
    return tuple(devices), driver


def smi_inventory(smi: str, note: str) -> Inventory:
    try:
        done = subprocess.run([smi, *SMI_QUERY], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Inventory(Source.NONE, note=f"{note}; nvidia-smi failed: {e}")
    if done.returncode != 0:
        return Inventory(Source.NONE, note=f"{note}; nvidia-smi exited {done.returncode}: "
                         f"{(done.stdout + done.stderr).strip()[:200]}")
    devices, driver = parse_smi(done.stdout)
    return Inventory(Source.NVIDIA_SMI, devices, driver, note=note)


def inventory(*, environ: Mapping[str, str] | None = None) -> Inventory:
    """This host's GPUs: NVML first, ``nvidia-smi`` as the fallback; never raises."""
    library = NVML_LIBRARY.get(environ) or "libnvidia-ml.so.1"
    try:
        return nvml_inventory(library)
    except ImportError:
        note = "pynvml is not installed (pip install 'cairn-resume[gpu]')"
    except OSError:
        note = f"NVML ({library}) does not load"
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError and whatever a driver raises
        note = f"NVML failed: {e}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Inventory(Source.NONE, note=note)
    return smi_inventory(smi, note)


__all__ = ["GpuDevice", "GpuUse", "Inventory", "MIN_DRIVER", "REMAP_DRIVER", "Source",
           "inventory", "nvml_inventory", "parse_smi", "visible"]
