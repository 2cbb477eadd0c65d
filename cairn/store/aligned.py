"""Page-aligned memory, and which part of a read ``O_DIRECT`` can take.

A state restore from a local store reads with ``O_DIRECT``: the disk's DMA fills the caller's
fresh memory, with neither a page-cache copy nor the page cache's own allocations. Measured on
the 2-core dev VM with a cold cache, 1.5 GB read and hashed on 8 threads: 1.9-2.0 s with
``O_DIRECT`` against 2.6-2.9 s through the page cache (ADR 0016). Linux requires the file
offset, the length and the memory address of such a read to be multiples of the device's block
size; 4096 covers every common device. Packs therefore start every chunk of at least
:data:`DIRECT_IO_MIN` bytes at a multiple of :data:`DIRECT_IO_ALIGN`
(:mod:`cairn.store.packs`), and a state restore reads into :func:`aligned_buffer` memory.
"""

from __future__ import annotations

import ctypes
import mmap

DIRECT_IO_ALIGN = 4096
# Smaller reads go through the page cache: O_DIRECT gains nothing on them, and packing small
# chunks without padding keeps small files (state.json, CRIU's small images) dense.
DIRECT_IO_MIN = 64 << 10


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` (rounded up to a page) of private anonymous memory at a page boundary.

    Pages are allocated on first touch, as with ``malloc``; the memory is returned to the
    system when the last reference (a memoryview, a ``torch.frombuffer`` tensor) goes.
    """
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def cached_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of writable memory whose address is never a multiple of
    :data:`DIRECT_IO_ALIGN`, so a local read into it always goes through the page cache and
    its readahead (a streamed read, ADR 0016). ``malloc`` memory is 16-byte aligned and lands
    on a page boundary by chance (about one large buffer in 256), so the view starts one byte in.
    """
    return memoryview(bytearray(nbytes + 1))[1:]


def direct_length(offset: int, buffer: memoryview) -> int:
    """How many leading bytes of a read of ``len(buffer)`` bytes at file ``offset`` into the
    writable ``buffer`` may use ``O_DIRECT``: a multiple of :data:`DIRECT_IO_ALIGN`, or 0 when
    the read is small or the offset or the buffer's address is not aligned."""
    if len(buffer) < DIRECT_IO_MIN or offset % DIRECT_IO_ALIGN or buffer.readonly:
        return 0
    if ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % DIRECT_IO_ALIGN:
        return 0
    return len(buffer) - len(buffer) % DIRECT_IO_ALIGN
