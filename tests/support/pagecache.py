"""Which pages of a file sit in the page cache (``mincore``), and evicting them: to check that a
read bypassed the cache (``O_DIRECT``) rather than trusting that it did."""

from __future__ import annotations

import ctypes
import mmap
import os

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def require_page_cache(path: str) -> None:
    """Skip the test where ``path``'s filesystem keeps every page in memory (residency then
    tells nothing about how a file was read)."""
    import pytest

    from cairn.store.local import filesystem_type

    if filesystem_type(path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{path} is on a filesystem whose pages always stay in memory")


def pack_files(store, manifest) -> list[str]:  # noqa: ANN001 - a local Store and a Manifest
    """The files of the packs ``manifest`` refers to, in a local store (an encrypted one's
    packs pass through its sealing backend raw, under their own names)."""
    backend = getattr(store.backend, "inner", store.backend)
    return sorted({os.path.join(backend.root, c.pack) for c in manifest.chunk_refs()})


def evict(path: str) -> None:
    """Drop the file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache now."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f:
        # A private writable mapping gives ctypes an address; mapping faults nothing in.
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    view = ctypes.c_char.from_buffer(mapped)
    try:
        pages = (size + PAGE - 1) // PAGE
        vector = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vector):
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(byte & 1 for byte in vector)
    finally:
        del view  # the mapping cannot close while ctypes holds its buffer
        mapped.close()
