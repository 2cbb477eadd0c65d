"""Staging copies: every tensor lands in its slot as its C-order bytes, whatever its layout,
dtype or the number of copying threads."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cairn.state.codec import cpu_bytes
from cairn.state.staging import _PREFAULT_PIECE, StagingBuffer, plan


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
    buffer = StagingBuffer(_PREFAULT_PIECE + 1, prefault=False)  # two pieces
    try:
        stop.set()
        assert buffer.prefault(stop=stop) is False
        assert buffer.prefault() is True
    finally:
        buffer.close()


def allocated(buffer: StagingBuffer) -> int:
    """The bytes of the buffer's memory file that have pages (shmem counts them in blocks)."""
    return os.fstat(buffer.fd).st_blocks * 512


def test_prefault_allocates_only_the_bytes_asked_for() -> None:
    buffer = StagingBuffer(3 * _PREFAULT_PIECE, prefault=False)
    try:
        assert allocated(buffer) == 0
        assert buffer.prefault(nbytes=_PREFAULT_PIECE + 4096) is True
        assert allocated(buffer) == _PREFAULT_PIECE + 4096  # the headroom stays unallocated
    finally:
        buffer.close()


def test_prefault_on_several_threads_allocates_every_page() -> None:
    buffer = StagingBuffer(5 * _PREFAULT_PIECE + 4096, prefault=False)
    try:
        assert buffer.prefault(threads=3) is True
        assert allocated(buffer) == buffer.capacity
    finally:
        buffer.close()


def test_a_waiting_thread_helps_a_prefault_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first piece's fault is held until the helper has done the rest: the helper took
    every other piece, and prefault returns only once all of them are in."""
    buffer = StagingBuffer(4 * _PREFAULT_PIECE, prefault=False)
    populate = buffer._populate
    first_taken, helper_done = threading.Event(), threading.Event()
    taken_by: dict[int, str] = {}

    def held_populate(start: int, length: int) -> None:
        taken_by[start] = threading.current_thread().name
        if start == 0:
            first_taken.set()
            assert helper_done.wait(30)
        populate(start, length)

    monkeypatch.setattr(buffer, "_populate", held_populate)
    result: list[bool] = []
    warm = threading.Thread(target=lambda: result.append(buffer.prefault()), name="warm-up")
    try:
        warm.start()
        assert first_taken.wait(30)
        buffer.help_prefault()
        helper = threading.current_thread().name
        assert [taken_by[i * _PREFAULT_PIECE] for i in range(4)] == ["warm-up"] + [helper] * 3
        assert warm.is_alive()  # still faulting its own piece
        helper_done.set()
        warm.join(30)
        assert result == [True]
        assert allocated(buffer) == buffer.capacity
        buffer.help_prefault()  # after the prefault ended: nothing to take, returns at once
    finally:
        helper_done.set()
        warm.join(30)
        buffer.close()


def test_a_failing_piece_fails_the_prefault(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = StagingBuffer(3 * _PREFAULT_PIECE, prefault=False)
    populate = buffer._populate

    def failing(start: int, length: int) -> None:
        if start == _PREFAULT_PIECE:
            raise OSError(12, "Cannot allocate memory")
        populate(start, length)

    monkeypatch.setattr(buffer, "_populate", failing)
    try:
        with pytest.raises(OSError, match="Cannot allocate memory"):
            buffer.prefault(threads=2)
    finally:
        buffer.close()


def test_an_interrupt_while_pre_faulting_reaches_the_thread_it_hit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during a first snapshot's help is not swallowed as a pre-fault failure."""
    buffer = StagingBuffer(2 * _PREFAULT_PIECE, prefault=False)

    def interrupted(start: int, length: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(buffer, "_populate", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            buffer.prefault()
        assert buffer._prefaulting is None
    finally:
        buffer.close()
