"""The compatibility record stored with every process snapshot.

A process image only runs where the machine looks like the one it was dumped on, and it is
only *wanted* where the workload is the same: a fixed script must never resume the stale
process of the broken one. :func:`current_record` describes this host and workload;
:func:`differences` says, in words, why a stored record does not match (empty: restore).

The comparison is strict equality on every field. Kernel and CRIU versions are compared
exactly because a CRIU image is only guaranteed to restore with the CRIU that wrote it on the
kernel it ran on; CPU flags because a process that picked AVX-512 code paths at start crashes
on a CPU without them.

GPUs are the exception to equality: a record holds each visible GPU's UUID, model and memory
(and, in the record of a snapshot with GPU state, the device memory the workload held on
each), and :mod:`cairn.process.gpu_map` decides whether the GPUs it held memory on map onto
this host's (same model, enough of them, the memory free, driver >= 580 for other UUIDs). A
snapshot without GPU state, or a record written before GPUs were recorded, keeps the strict
rule on GPU models and count.

A snapshot that does not fit is not restored: the try starts fresh and logs the reasons
(``cairn run``'s rule for every incompatible snapshot).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from cairn.process import gpu_map as gpu_map_mod
from cairn.process import gpus as gpus_mod
from cairn.process.criu import criu_version, format_version
from cairn.runtime.env import IMAGE_DIGEST
from cairn.store.hashing import digest

RECORD_SCHEMA = "cairn.process-compat/1"


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = sorted(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def _gpus(environ: Mapping[str, str] | None) -> dict[str, Any]:
    inv = gpus_mod.inventory(environ=environ)
    shown = gpus_mod.visible(inv.devices, environ)
    cuda = (f"{inv.cuda_driver // 1000}.{inv.cuda_driver % 1000 // 10}"
            if inv.cuda_driver else None)
    return {"count": len(shown), "models": [d.name for d in shown], "driver": inv.driver,
            "cuda": cuda,
            "gpus": [{"uuid": d.uuid, "name": d.name, "memory_total": d.memory_total,
                      "memory_used": d.memory_used} for d in shown]}


def with_gpu_use(record: Mapping[str, Any], use: Mapping[str, int]) -> dict[str, Any]:
    """``record`` as a snapshot stores it: each GPU with the bytes the workload held on it
    when it was dumped (what a target GPU must have free)."""
    gpus = [{**g, "workload_bytes": int(use.get(g["uuid"], 0))} for g in record.get("gpus", [])]
    return {**record, "gpus": gpus}


def _hash_file(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return digest(f.read())
    except OSError:
        return None


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def script_files(argv: Sequence[str], cwd: str) -> dict[str, str]:
    """BLAKE3 of the script the command runs: the program itself when it is a ``#!`` script,
    else the first argument naming an existing file (``python train.py``, ``bash run.sh``).
    Scanning stops at ``-m``/``-c``. Later arguments are data, not code: a metrics or output
    file named on the command line changes while the step runs."""
    out = {}
    program = shutil.which(argv[0]) or argv[0]
    if os.path.isfile(program) and _is_script(program):
        value = _hash_file(program)
        if value:
            out[argv[0]] = value
        return out
    for arg in list(argv)[1:]:
        if arg in ("-m", "-c"):
            break
        path = arg if os.path.isabs(arg) else os.path.join(cwd, arg)
        if os.path.isfile(path):
            value = _hash_file(path)
            if value:
                out[arg] = value
            break
    return out


def workload_fingerprint(argv: Sequence[str], *, cwd: str) -> dict[str, Any]:
    """The command, its working directory and the content hash of the files it names."""
    return {"argv": list(argv), "cwd": cwd, "files": script_files(argv, cwd)}


def current_record(argv: Sequence[str], *, cwd: str, criu: str | None,
                   env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This host and workload, as stored with each snapshot."""
    env = os.environ if env is None else env
    model, flags = _cpuinfo()
    version = criu_version(criu) if criu else None
    gpus = _gpus(env)
    return {
        "schema": RECORD_SCHEMA,
        "kernel": os.uname().release,
        "machine": os.uname().machine,
        "criu": format_version(version) if version else None,
        "cpu_model": model,
        "cpu_flags": " ".join(flags),
        "image_digest": env.get(IMAGE_DIGEST.name) or None,
        "gpu_models": gpus["models"],
        "gpu_count": gpus["count"],
        "nvidia_driver": gpus["driver"],
        "cuda": gpus["cuda"],
        "gpus": gpus["gpus"],
        "workload": workload_fingerprint(argv, cwd=cwd),
    }


_LABELS = {
    "schema": "record format", "kernel": "kernel", "machine": "architecture",
    "criu": "CRIU version", "cpu_model": "CPU model", "image_digest": "container image",
    "gpu_models": "GPU models", "gpu_count": "GPU count", "nvidia_driver": "NVIDIA driver",
    "cuda": "CUDA version",
}


def _checkpointed_gpus(stored: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The GPUs a snapshot holds device memory for: those the workload held memory on, or
    every recorded one where none shows any; none for a snapshot without GPU state (its
    record's GPUs carry no ``workload_bytes``)."""
    gpus = [g for g in stored.get("gpus") or [] if "workload_bytes" in g]
    used = [g for g in gpus if g["workload_bytes"] > 0]
    return used or gpus


def gpu_plan(stored: Mapping[str, Any], current: Mapping[str, Any], *,
             gpu_map: Mapping[str, str] | None = None) -> gpu_map_mod.GpuPlan:
    """Where the snapshot's GPUs restore here (``gpu_map``: ``CAIRN_GPU_MAP`` parsed)."""
    old = _checkpointed_gpus(stored)
    if not old:
        return gpu_map_mod.GpuPlan()
    return gpu_map_mod.plan(old, current.get("gpus") or [], driver=current.get("nvidia_driver"),
                            gpu_map=gpu_map)


def differences(stored: Mapping[str, Any], current: Mapping[str, Any], *,
                gpu_map: Mapping[str, str] | None = None) -> list[str]:
    """Why a snapshot with record ``stored`` must not be restored here; empty if it may."""
    reasons = []
    # The GPU plan judges models and count of a snapshot with GPU state; one without keeps
    # the strict rule (its process may still start using the GPUs it saw).
    by_plan = bool(_checkpointed_gpus(stored))
    for field, label in _LABELS.items():
        if by_plan and field in ("gpu_models", "gpu_count"):
            continue
        if stored.get(field) != current.get(field):
            reasons.append(f"{label} differs (snapshot: {stored.get(field)!r}, here: "
                           f"{current.get(field)!r})")
    plan = gpu_plan(stored, current, gpu_map=gpu_map)
    if plan.reason:
        reasons.append(plan.reason)
    old_flags = set(str(stored.get("cpu_flags") or "").split())
    new_flags = set(str(current.get("cpu_flags") or "").split())
    if old_flags != new_flags:
        missing = sorted(old_flags - new_flags)
        extra = sorted(new_flags - old_flags)
        reasons.append("CPU flags differ" + (f"; missing here: {' '.join(missing[:8])}" if missing
                                             else "") + (f"; only here: {' '.join(extra[:8])}"
                                                         if extra else ""))
    old_w, new_w = stored.get("workload") or {}, current.get("workload") or {}
    if old_w.get("argv") != new_w.get("argv"):
        reasons.append(f"the command changed (snapshot: {old_w.get('argv')!r}, now: "
                       f"{new_w.get('argv')!r})")
    elif old_w.get("cwd") != new_w.get("cwd"):
        reasons.append(f"the working directory changed (snapshot: {old_w.get('cwd')!r}, now: "
                       f"{new_w.get('cwd')!r})")
    else:
        old_files, new_files = old_w.get("files") or {}, new_w.get("files") or {}
        for name in sorted(set(old_files) | set(new_files)):
            if old_files.get(name) != new_files.get(name):
                reasons.append(f"{name} changed since the snapshot (content hash differs)")
    return reasons
