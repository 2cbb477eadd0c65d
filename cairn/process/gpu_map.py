"""Which GPU here each GPU of a snapshot restores onto (ADR 0024).

A retry on spot capacity lands on another node, whose GPUs have other UUIDs. The driver
restores a process onto other GPUs from driver 580 on, given one (old UUID, new UUID) pair per
checkpointed GPU, each target of the same chip and with the memory. :func:`plan` decides that
before CRIU runs: the snapshot's GPUs map, in the order the workload saw them, onto this
host's visible GPUs in theirs, unless ``CAIRN_GPU_MAP`` names targets. When no mapping works
the plan's ``reason`` is one line, and the snapshot is treated as any other that does not fit
here (the try starts fresh; see :mod:`cairn.process.compat`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime.env import GPU_MAP

REMAP_DRIVER = 580


@dataclass(frozen=True)
class GpuPlan:
    """``pairs``: (old UUID, new UUID) for every snapshot GPU, empty when each restores onto
    itself (no remap asked of the driver) unless ``CAIRN_GPU_MAP`` was given on driver >= 580,
    which always sends them; ``reason``: why it cannot restore here, or ''."""

    pairs: tuple[tuple[str, str], ...] = ()
    reason: str = ""


def parse_gpu_map(text: str | None) -> dict[str, str]:
    """``OLD_UUID=NEW_UUID,...`` (the form of ``CAIRN_GPU_MAP``) -> {old: new}."""
    out: dict[str, str] = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        old, sep, new = item.partition("=")
        if not sep or not old.startswith("GPU-") or not new.startswith("GPU-"):
            raise ConfigError(f"{GPU_MAP.name} must be OLD_UUID=NEW_UUID pairs, comma-separated "
                              f"(UUIDs as `nvidia-smi -L` shows, GPU-...); got {item!r}")
        if old in out:
            raise ConfigError(f"{GPU_MAP.name} maps {old} twice")
        out[old] = new
    if len(set(out.values())) != len(out):
        raise ConfigError(f"{GPU_MAP.name} maps two GPUs onto one: {text!r}")
    return out


def _driver_major(text: object) -> int:
    try:
        return int(str(text).split(".")[0])
    except ValueError:
        return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def plan(snapshot_gpus: Sequence[Mapping[str, Any]], here: Sequence[Mapping[str, Any]], *,
         driver: str | None, gpu_map: Mapping[str, str] | None = None) -> GpuPlan:
    """Map ``snapshot_gpus`` (the compatibility record's ``gpus``: uuid, name, and the bytes
    the workload held there as ``workload_bytes``) onto ``here`` (this host's visible GPUs:
    uuid, name, memory_total, memory_used) with this ``driver`` version."""
    gpu_map = dict(gpu_map or {})
    by_uuid = {g["uuid"]: g for g in here}
    unknown = sorted(set(gpu_map) - {g["uuid"] for g in snapshot_gpus})
    if unknown:
        return GpuPlan(reason=f"{GPU_MAP.name} names {', '.join(unknown)}, which the snapshot "
                       "did not run on")
    if len(here) < len(snapshot_gpus):
        return GpuPlan(reason=f"the snapshot ran on {len(snapshot_gpus)} GPU(s) and "
                       f"{len(here)} are visible here")
    free = [g for g in here if g["uuid"] not in gpu_map.values()]
    targets: list[Mapping[str, Any]] = []
    for old in snapshot_gpus:
        if old["uuid"] in gpu_map:
            target = by_uuid.get(gpu_map[old["uuid"]])
            if target is None:
                return GpuPlan(reason=f"{GPU_MAP.name} maps {old['uuid']} onto "
                               f"{gpu_map[old['uuid']]}, which is not visible here")
        else:
            target = free.pop(0)
        targets.append(target)
    for old, new in zip(snapshot_gpus, targets):
        if old.get("name") != new.get("name"):
            return GpuPlan(reason=f"GPU {old['uuid']} was a {old.get('name')}; its target here "
                           f"{new['uuid']} is a {new.get('name')} (the driver restores onto "
                           "the same chip only)")
        need = int(old.get("workload_bytes") or 0)
        available = int(new.get("memory_total") or 0) - int(new.get("memory_used") or 0)
        if need > available:
            return GpuPlan(reason=f"GPU {new['uuid']} has {_gib(available)} free and the "
                           f"snapshot holds {_gib(need)} of device memory for it")
    pairs = tuple((old["uuid"], new["uuid"]) for old, new in zip(snapshot_gpus, targets))
    if all(o == n for o, n in pairs) and not (gpu_map and _driver_major(driver) >= REMAP_DRIVER):
        return GpuPlan()  # the same GPUs: nothing to ask of the driver (unless asked by map)
    if _driver_major(driver) < REMAP_DRIVER:
        moved = ", ".join(f"{o} -> {n}" for o, n in pairs if o != n)
        return GpuPlan(reason=f"the snapshot's GPUs are not here ({moved}) and driver "
                       f"{driver} cannot restore onto other GPUs (that needs {REMAP_DRIVER}+)")
    return GpuPlan(pairs=pairs)


__all__ = ["GpuPlan", "parse_gpu_map", "plan"]
