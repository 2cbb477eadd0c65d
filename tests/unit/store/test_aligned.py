"""Which reads may use O_DIRECT, and page-aligned buffers."""

from __future__ import annotations

import ctypes

import pytest

from cairn.store.aligned import (DIRECT_IO_ALIGN, DIRECT_IO_MIN, aligned_buffer, cached_buffer,
                                 direct_length)


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 5 << 20])
def test_aligned_buffers_start_at_a_page_and_hold_the_size(nbytes: int) -> None:
    buffer = aligned_buffer(nbytes)
    view = memoryview(buffer)
    assert address(view) % DIRECT_IO_ALIGN == 0
    assert len(buffer) >= nbytes
    view[nbytes - 1] = 7  # writable to the last byte asked for
    assert buffer[nbytes - 1] == 7


def test_an_aligned_read_takes_its_whole_aligned_part() -> None:
    view = memoryview(aligned_buffer(DIRECT_IO_MIN + 100))
    assert direct_length(8 * DIRECT_IO_ALIGN, view) == DIRECT_IO_MIN
    assert direct_length(0, view[:DIRECT_IO_MIN]) == DIRECT_IO_MIN


def test_small_unaligned_or_read_only_reads_take_none() -> None:
    view = memoryview(aligned_buffer(2 * DIRECT_IO_MIN))
    assert direct_length(0, view[:DIRECT_IO_MIN - 1]) == 0  # too small to gain anything
    assert direct_length(512, view) == 0  # file offset not aligned
    assert direct_length(0, view[1:DIRECT_IO_MIN + 1]) == 0  # memory not aligned
    assert direct_length(0, memoryview(bytes(DIRECT_IO_MIN))) == 0  # read-only


def test_cached_buffers_are_never_read_with_o_direct() -> None:
    # malloc'ed memory is page-aligned by chance (about one large buffer in 256): a streamed
    # read into a plain bytearray went O_DIRECT now and then (CI, 2026-12-06).
    sizes = [DIRECT_IO_MIN, 1 << 20, (4 << 20) + 4096]
    for i in range(600):
        view = cached_buffer(sizes[i % len(sizes)])
        assert len(view) == sizes[i % len(sizes)] and not view.readonly
        assert direct_length(0, view) == 0
    assert direct_length(0, memoryview(aligned_buffer(DIRECT_IO_MIN))) == DIRECT_IO_MIN
