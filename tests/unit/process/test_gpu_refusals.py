"""cairn.process.gpu_refusals on this test's own process: what it holds for real (a mapped,
unlinked /dev/shm segment) and inventories built by hand for the MIG rule the preflight
otherwise reaches first. The end-to-end refusals under ``cairn run`` are in
tests/integration/process/test_gpu_refusals.py."""

from __future__ import annotations

import mmap
import os
import uuid

import pytest

from cairn.process import gpu_refusals, workload
from cairn.process.gpus import GpuDevice, GpuUse, Inventory, Source

A = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
B = "GPU-bbbbbbbb-0000-1111-2222-333333333333"


def _own() -> tuple[list[int], list[workload.OpenFile]]:
    pid = os.getpid()
    return [pid], workload.open_files([pid])


def test_a_plain_process_is_not_refused() -> None:
    if gpu_refusals.mps_pipe(os.getpid()) is not None:
        pytest.skip("an MPS daemon's pipe is visible here")
    tree, files = _own()
    assert gpu_refusals.problems(tree, files, cuda_pids=tree) == []


def test_an_unlinked_nccl_segment_still_mapped_is_refused() -> None:
    path = f"/dev/shm/nccl-cairn-unit-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 4096)
        segment = mmap.mmap(fd, 4096)
    finally:
        os.close(fd)
        os.unlink(path)  # as NCCL does once both ends have it
    try:
        tree, files = _own()
        assert tree[0] in gpu_refusals.held_paths(tree, files)[path]
        (problem,) = gpu_refusals.problems(tree, files, cuda_pids=[])
        assert problem.what.startswith(f"the workload holds NCCL shared-memory segments (it "
                                       f"talks to other ranks): {path} (pids {tree[0]})")
        assert problem.fix == gpu_refusals.STATE_MODE_FIX
    finally:
        segment.close()


def test_mig_counts_only_on_the_gpus_in_use() -> None:
    inventory = Inventory(Source.NVML, (GpuDevice(0, A, "H100", 80 << 30, 0, "9.0", mig=True),
                                        GpuDevice(1, B, "H100", 80 << 30, 0, "9.0")))
    tree, files = _own()
    on_b = GpuUse({B: 1 << 30}, matched=True)
    assert not [p for p in gpu_refusals.problems(tree, files, cuda_pids=[], inventory=inventory,
                                                 use=on_b) if "MIG" in p.what]
    (problem,) = [p for p in gpu_refusals.problems(tree, files, cuda_pids=[],
                                                   inventory=inventory,
                                                   use=GpuUse({A: 1 << 30}, matched=True))
                  if "MIG" in p.what]
    assert problem.what == f"MIG mode is on for GPU {A}: the driver cannot checkpoint MIG instances"
    assert problem.fix.startswith("run it on whole GPUs without MIG, or use state mode")
