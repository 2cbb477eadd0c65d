"""Staging copies: every tensor lands in its slot as its C-order bytes, whatever its layout,
dtype or the number of copying threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cairn.state.codec import cpu_bytes
from cairn.state.staging import StagingBuffer, plan


def tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(300, 700),  # big enough to be split between threads
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        torch.randn(2000, 300)[:, 5:250],  # non-contiguous and large
        torch.tensor(3.5),  # 0-dim
        torch.randn(17).to(torch.bfloat16),
        torch.randn(5).to(torch.float16),
        torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate view
        -torch.randn(4, dtype=torch.complex128),
        torch.tensor([True, False, True]),
        torch.empty(0, 4),
        torch.randint(-5, 5, (9,), dtype=torch.int8),
        torch.randint(0, 1 << 40, (7,), dtype=torch.int64),
        torch.randn(8).to(torch.float8_e4m3fn),
    ]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_layout_and_dtype_lands_in_c_order(workers: int) -> None:
    arrays = tensors()
    slots, total = plan([t.numel() * t.element_size() for t in arrays])
    buffer = StagingBuffer(total)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        buffer.map[:] = b"\xaa" * buffer.capacity
        buffer.copy_cpu_tensors(list(zip(slots, arrays)), pool=pool, workers=workers)
        for slot, tensor in zip(slots, arrays):
            expected = bytes(cpu_bytes(tensor.resolve_conj().resolve_neg().contiguous()))
            got = buffer.map[slot.offset:slot.offset + slot.nbytes]
            assert got == expected, (tensor.dtype, tuple(tensor.shape))
    finally:
        pool.shutdown()
        buffer.close()


def test_a_slot_too_small_is_refused() -> None:
    buffer = StagingBuffer(64)
    try:
        with pytest.raises(ValueError):
            buffer.copy_cpu_tensors([(plan([64])[0][0], torch.zeros(32))])
    finally:
        buffer.close()


def test_prefault_stops_when_asked() -> None:
    stop = threading.Event()
    buffer = StagingBuffer((64 << 20) + 1, prefault=False)  # two pieces
    try:
        stop.set()
        assert buffer.prefault(stop=stop) is False
        assert buffer.prefault() is True
    finally:
        buffer.close()
