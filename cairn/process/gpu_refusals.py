"""GPU workloads a process snapshot cannot carry, found before the dump (issue 17 item 6).

The driver's checkpoint API stops and copies *one process's* device memory. A workload whose
processes talk to each other over the GPU or the network fabric cannot be stopped at one
instant and put back on other GPUs: a peer would be left waiting on a collective (a lock that
never gets the process quiet, a dump that hangs), and what the processes share (NCCL's shared
memory rings, CUDA IPC handles, RDMA queue pairs) does not exist on the next node. So each of
these is refused before the GPU is locked, with one line naming the fix:

* a second process in the tree holding a CUDA context (DDP / ``torchrun`` ranks, say);
* an open or mapped ``/dev/infiniband/*`` device (RDMA verbs; NCCL's IB transport);
* NCCL's shared-memory segments (``/dev/shm/nccl-*``), open or mapped;
* the CUDA driver's IPC / MPS shared memory (``/dev/shm/cuda.shm.*``), open or mapped;
* an MPS client: an MPS control daemon's pipe (``$CUDA_MPS_PIPE_DIRECTORY/control``, default
  ``/tmp/nvidia-mps``) reachable from a CUDA process, which makes CUDA connect to it, or NVML
  listing the workload among a GPU's MPS clients;
* MIG: a GPU in use with MIG mode on (NVML), or a ``MIG-`` device in ``CUDA_VISIBLE_DEVICES``.

UVM (managed) memory leaves no trace in ``/proc`` (every CUDA process maps
``/dev/nvidia-uvm``): the driver refuses it at the checkpoint with ``CUDA_ERROR_NOT_SUPPORTED``,
before anything moved, and :mod:`cairn.process.cuda` turns that into the same advice.

Loading NCCL is not a refusal: every CUDA build of torch maps ``libnccl.so`` whether or not it
communicates, so only the resources NCCL uses to talk to a peer count.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping

from cairn.process.gpus import GpuUse, Inventory
from cairn.process.workload import OpenFile, Problem

STATE_MODE_FIX = ("use state mode (cairn.Checkpointer; multi-GPU or multi-process jobs under "
                  "torchrun, one Checkpointer per rank)")
INFINIBAND = "/dev/infiniband/"
NCCL_SHM = "/dev/shm/nccl-"
CUDA_SHM = "/dev/shm/cuda.shm."
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"
_DELETED = " (deleted)"


def _mapped_paths(pid: int) -> set[str]:
    """The files ``pid`` maps (``/proc/PID/maps``' path column), ``(deleted)`` stripped."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(parts[5].removesuffix(_DELETED))
    return out


def held_paths(tree: Iterable[int], files: Iterable[OpenFile]) -> dict[str, list[int]]:
    """Every file the processes hold open or mapped -> the PIDs holding it."""
    held: dict[str, list[int]] = {}
    for f in files:
        if f.target.startswith("/"):
            held.setdefault(f.target.removesuffix(_DELETED), []).append(f.pid)
    for pid in tree:
        for path in _mapped_paths(pid):
            pids = held.setdefault(path, [])
            if pid not in pids:
                pids.append(pid)
    return held


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _pids(pids: Iterable[int]) -> str:
    return ", ".join(str(p) for p in sorted(set(pids)))


def _with_prefix(held: Mapping[str, list[int]], prefix: str) -> tuple[list[str], list[int]]:
    paths = sorted(p for p in held if p.startswith(prefix))
    return paths, sorted({pid for p in paths for pid in held[p]})


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def mps_pipe(pid: int) -> str | None:
    """The MPS control pipe ``pid`` would connect to (as that process sees the filesystem),
    or None when there is none."""
    directory = _environ(pid).get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    control = os.path.join(directory, "control")
    try:
        mode = os.stat(f"/proc/{pid}/root{control}").st_mode
    except OSError:
        return None
    return control if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode) else None


def _nvml_mps_clients(tree: list[int], inventory: Inventory | None,
                      use: GpuUse | None) -> str:
    """NVML's MPS clients on the GPUs in use, as a phrase ('' for none): the workload's own
    PIDs where they match; where they cannot (``use`` not matched: a container sees host
    PIDs), any client on its GPUs, since a GPU shared through MPS serves them all so."""
    if inventory is None:
        return ""
    mine = set(tree)
    for uuid, pids in sorted(inventory.mps_clients.items()):
        if use is not None and use.per_gpu and uuid not in use.per_gpu:
            continue
        if pids & mine:
            return f"NVML lists pids {_pids(pids & mine)} as MPS clients of GPU {uuid}"
        if use is not None and not use.matched:
            return f"NVML lists {len(pids)} MPS client(s) of GPU {uuid}, which it uses"
    return ""


def problems(tree: list[int], files: list[OpenFile], *, cuda_pids: list[int],
             inventory: Inventory | None = None, use: GpuUse | None = None) -> list[Problem]:
    """What in the workload ``tree`` (its descriptors ``files``; ``cuda_pids``: those holding a
    CUDA context) a process snapshot cannot carry (module docstring), one Problem each."""
    out: list[Problem] = []
    if len(cuda_pids) > 1:
        out.append(Problem(
            what=f"{len(cuda_pids)} processes of the workload hold CUDA contexts (pids "
                 f"{_pids(cuda_pids)}): a multi-process GPU job (DDP ranks) cannot be stopped "
                 "and moved one process at a time", fix=STATE_MODE_FIX))
    held = held_paths(tree, files)
    for prefix, what in ((INFINIBAND, "holds InfiniBand/RDMA devices"),
                         (NCCL_SHM, "holds NCCL shared-memory segments (it talks to other ranks)"),
                         (CUDA_SHM, "holds the CUDA driver's IPC/MPS shared memory")):
        paths, pids = _with_prefix(held, prefix)
        if paths:
            out.append(Problem(what=f"the workload {what}: {_listed(paths)} (pids {_pids(pids)})",
                               fix=STATE_MODE_FIX))
    clients = {pid: pipe for pid in cuda_pids if (pipe := mps_pipe(pid)) is not None}
    listed = _nvml_mps_clients(tree, inventory, use)
    if clients or listed:
        where = (f"{_listed(sorted(set(clients.values())))}, pids {_pids(clients)}" if clients
                 else listed)
        out.append(Problem(
            what=f"the workload is an MPS client ({where}): the driver cannot checkpoint MPS "
                 "clients", fix="run it on whole GPUs without the MPS daemon, or " + STATE_MODE_FIX))
    mig = sorted({d.uuid for d in (inventory.devices if inventory else ())
                  if d.mig and (use is None or d.uuid in use.per_gpu)})
    mig_env = sorted(pid for pid in cuda_pids
                     if "MIG-" in _environ(pid).get("CUDA_VISIBLE_DEVICES", ""))
    if mig or mig_env:
        where = (f"MIG mode is on for GPU {', '.join(mig)}" if mig
                 else f"pids {_pids(mig_env)} see MIG devices (CUDA_VISIBLE_DEVICES)")
        out.append(Problem(what=f"{where}: the driver cannot checkpoint MIG instances",
                           fix="run it on whole GPUs without MIG, or " + STATE_MODE_FIX))
    return out


__all__ = ["STATE_MODE_FIX", "held_paths", "mps_pipe", "problems"]
