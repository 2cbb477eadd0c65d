"""Read the few CRIU image fields cairn needs, without CRIU's Python bindings.

CRIU images are ``[u32 head magic][u32 image magic]`` followed by entries, each a little-endian
``u32`` length and one protobuf message (``images/*.proto`` in CRIU's source, MIT licensed).
cairn reads a few of them: the pagemap (where each memory region's pages lie in the
``pages-*.img`` file, so ingest can start a chunk at every region and dedup survives regions
that move), the dump statistics (CRIU's own frozen time), the open regular files (the size
of every file at the moment of the dump) and which of them were unlinked then. A tiny
wire-format decoder is enough for that and keeps process mode free of a protobuf dependency.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from cairn.exceptions import CairnError

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

IMG_COMMON_MAGIC = 0x54564319
IMG_SERVICE_MAGIC = 0x55105940
PAGEMAP_MAGIC = 0x56084025
STATS_MAGIC = 0x57093306
FILES_MAGIC = 0x56303138
FDINFO_MAGIC = 0x56213732
REMAP_FPATH_MAGIC = 0x59133954

# pagemap_entry.flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2

FD_TYPE_REG = 1  # fd_types.REG in images/fdinfo.proto


class ImageError(CairnError):
    """A CRIU image is not what this version of cairn understands."""


# -- protobuf wire format ---------------------------------------------------------------------

def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ImageError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ImageError("varint too long")


def fields(message: bytes) -> Iterator[tuple[int, int | bytes]]:
    """Yield ``(field number, value)``: an int for varint and fixed fields, bytes for
    length-delimited ones. Groups (unused by CRIU) are refused."""
    pos = 0
    while pos < len(message):
        tag, pos = _varint(message, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(message, pos)
            yield number, value
        elif wire == 1:
            yield number, struct.unpack_from("<Q", message, pos)[0]
            pos += 8
        elif wire == 2:
            length, pos = _varint(message, pos)
            if pos + length > len(message):
                raise ImageError("truncated field")
            yield number, message[pos:pos + length]
            pos += length
        elif wire == 5:
            yield number, struct.unpack_from("<I", message, pos)[0]
            pos += 4
        else:
            raise ImageError(f"unsupported protobuf wire type {wire}")


def _first(message: bytes) -> dict[int, int | bytes]:
    out: dict[int, int | bytes] = {}
    for number, value in fields(message):
        out.setdefault(number, value)
    return out


# -- image files ------------------------------------------------------------------------------

def entries(path: str | os.PathLike[str], *, magic: int) -> list[bytes]:
    """The protobuf messages of the image at ``path``, checking its magic numbers."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ImageError(f"{path}: too short for a CRIU image")
    head, kind = struct.unpack_from("<II", data, 0)
    if head not in (IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC) or kind != magic:
        raise ImageError(f"{path}: magic {head:#x}/{kind:#x}, expected {magic:#x}; "
                         "not an image of a CRIU version cairn knows")
    out, pos = [], 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError(f"{path}: truncated entry header")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise ImageError(f"{path}: truncated entry")
        out.append(data[pos:pos + size])
        pos += size
    return out


@dataclass(frozen=True)
class PageRun:
    """One pagemap entry: ``nr_pages`` pages at ``vaddr``; ``present`` ones lie in the pages
    image, in pagemap order."""

    vaddr: int
    nr_pages: int
    flags: int

    @property
    def present(self) -> bool:
        # Old images have no flags: their entries are present unless "in parent".
        return bool(self.flags & PE_PRESENT)


def read_pagemap(path: str | os.PathLike[str]) -> tuple[int, list[PageRun]]:
    """``(pages_id, runs)`` of a ``pagemap-<pid>.img`` (the pages live in
    ``pages-<pages_id>.img``)."""
    messages = entries(path, magic=PAGEMAP_MAGIC)
    if not messages:
        raise ImageError(f"{path}: no pagemap head")
    head = _first(messages[0])
    pages_id = int(head.get(1, 0))
    runs = []
    for message in messages[1:]:
        f = _first(message)
        flags = int(f.get(4, 0))
        if 4 not in f:
            flags = PE_PARENT if f.get(3) else PE_PRESENT
        runs.append(PageRun(vaddr=int(f.get(1, 0)), nr_pages=int(f.get(2, 0)), flags=flags))
    return pages_id, runs


# Page images are cut finer than the store's default chunk: a training process dirties memory
# in scattered places (Python's reference counts alone touch every object it reads), and a
# chunk is rewritten whole when one of its pages changed. 32 KiB keeps a snapshot that
# changed 10% of memory in 64 KiB runs near 15% written, at about 4 MB of manifest per GiB.
PAGE_CHUNK = 32 << 10


def _chunk_starts(runs: list[PageRun], every: int) -> Iterator[tuple[int, int]]:
    offset = 0
    for run in runs:
        if not run.present:
            continue
        yield offset, run.vaddr
        length = run.nr_pages * PAGE_SIZE
        first = -run.vaddr % every or every
        for at in range(offset + first, offset + length, every):
            yield at, run.vaddr + (at - offset)
        offset += length


def page_cuts(runs: list[PageRun], *, every: int = PAGE_CHUNK) -> list[int]:
    """Offsets in the pages image where chunks must begin: where each present run begins and
    wherever its virtual address crosses a multiple of ``every``. Chunks then stay identical
    from one dump to the next when other regions grow, shrink or move, and pages that COW
    children share with their parent dedup against each other."""
    return [offset for offset, _ in _chunk_starts(runs, every)]


def pages_layout_by_file(image_dir: str | os.PathLike[str]
                         ) -> dict[str, tuple[list[int], list[int]]]:
    """For every ``pages-<id>.img`` in ``image_dir``, its :func:`page_cuts` offsets and the
    virtual address at each (from its pagemap): where each chunk sits in the process, which
    stays true across dumps (the store's delta locator)."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    for name in sorted(os.listdir(image_dir)):
        if name.startswith("pagemap-") and name.endswith(".img"):
            pages_id, runs = read_pagemap(os.path.join(image_dir, name))
            starts = list(_chunk_starts(runs, PAGE_CHUNK))
            out[f"pages-{pages_id}.img"] = ([o for o, _ in starts], [v for _, v in starts])
    return out


@dataclass(frozen=True)
class DumpStats:
    """CRIU's own dump statistics (``stats-dump``), times in microseconds."""

    freezing_us: int
    frozen_us: int
    memdump_us: int
    memwrite_us: int
    pages_scanned: int
    pages_written: int


def read_dump_stats(image_dir: str | os.PathLike[str]) -> DumpStats:
    messages = entries(os.path.join(image_dir, "stats-dump"), magic=STATS_MAGIC)
    if not messages:
        raise ImageError("stats-dump holds no entry")
    dump = _first(messages[0]).get(1)
    if not isinstance(dump, bytes):
        raise ImageError("stats-dump has no dump statistics")
    f = _first(dump)
    return DumpStats(freezing_us=int(f.get(1, 0)), frozen_us=int(f.get(2, 0)),
                     memdump_us=int(f.get(3, 0)), memwrite_us=int(f.get(4, 0)),
                     pages_scanned=int(f.get(5, 0)), pages_written=int(f.get(7, 0)))


@dataclass(frozen=True)
class RegFile:
    """A regular file the dumped tree held open or mapped: its name (as CRIU recorded it,
    relative to its mount), open flags, position and size at the moment of the dump, and its
    id in ``files.img`` (what ``fdinfo-*.img`` entries refer to)."""

    name: str
    flags: int
    pos: int
    size: int | None
    id: int = 0


def _files_of_type(image_dir: str | os.PathLike[str], fd_type: int,
                   field: int) -> Iterator[tuple[dict[int, int | bytes], dict[int, int | bytes]]]:
    """``(entry, its body)`` for each ``files.img`` entry of ``fd_type``, whose body is the
    sub-message in ``field`` (3 for a regular file, 16 for a unix socket)."""
    path = os.path.join(image_dir, "files.img")
    if not os.path.exists(path):
        return
    for message in entries(path, magic=FILES_MAGIC):
        f = _first(message)
        body = f.get(field)
        if f.get(1) == fd_type and isinstance(body, bytes):
            yield f, _first(body)


def read_reg_files(image_dir: str | os.PathLike[str]) -> list[RegFile]:
    """Every regular file in ``files.img`` (CRIU >= 3.15 keeps them there)."""
    out = []
    for f, r in _files_of_type(image_dir, FD_TYPE_REG, 3):
        name = r.get(6, b"")
        out.append(RegFile(name=name.decode(errors="surrogateescape") if isinstance(name, bytes) else "",
                           flags=int(r.get(2, 0)), pos=int(r.get(3, 0)),
                           size=int(r[8]) if 8 in r else None, id=int(f.get(2, 0))))
    return out


def read_fd_file_ids(image_dir: str | os.PathLike[str]) -> set[int]:
    """The ``files.img`` ids of the regular files some process of the dump holds as a file
    descriptor (``fdinfo-*.img``), as opposed to files only mapped into memory."""
    ids: set[int] = set()
    for name in os.listdir(image_dir):
        if name.startswith("fdinfo-") and name.endswith(".img"):
            for message in entries(os.path.join(image_dir, name), magic=FDINFO_MAGIC):
                f = _first(message)
                if f.get(3) == FD_TYPE_REG:
                    ids.add(int(f.get(1, 0)))
    return ids


# remap_file_path_entry.remap_type (images/remap-file-path.proto); before it existed, a
# ghost was flagged in the top bit of remap_id (criu/files-reg.c: REMAP_GHOST).
REMAP_TYPE_LINKED = 0
REMAP_TYPE_GHOST = 1
_REMAP_GHOST_BIT = 1 << 31


def read_unlinked_file_ids(image_dir: str | os.PathLike[str]) -> set[int]:
    """The ``files.img`` ids of the regular files that were unlinked when they were dumped
    (``remap-fpath.img`` remaps them to a ghost copy in the image or to a link CRIU made):
    CRIU restores those itself, under a name of its own, and never opens them by their path."""
    path = os.path.join(image_dir, "remap-fpath.img")
    if not os.path.exists(path):
        return set()
    ids: set[int] = set()
    for message in entries(path, magic=REMAP_FPATH_MAGIC):
        f = _first(message)
        kind = f.get(3)
        if kind is None:
            kind = REMAP_TYPE_GHOST if int(f.get(2, 0)) & _REMAP_GHOST_BIT else REMAP_TYPE_LINKED
        if kind in (REMAP_TYPE_LINKED, REMAP_TYPE_GHOST):
            ids.add(int(f.get(1, 0)))
    return ids


FD_TYPE_UNIXSK = 5


def read_unix_socket_paths(image_dir: str | os.PathLike[str]) -> list[str]:
    """Filesystem paths of the unix sockets the dumped tree had bound (abstract names left
    out). CRIU binds them again on restore but does not create their directories, and some of
    those live in temporary directories that are gone by then (Python's multiprocessing binds
    its resource sharer in ``/tmp/pymp-*``, which the DataLoader uses)."""
    out: list[str] = []
    for _, u in _files_of_type(image_dir, FD_TYPE_UNIXSK, 16):
        name = u.get(11, b"")
        if not isinstance(name, bytes) or not name or name.startswith(b"\0"):
            continue
        text = name.decode(errors="surrogateescape")
        directory = u.get(14)
        if not text.startswith("/") and isinstance(directory, bytes):
            text = os.path.join(directory.decode(errors="surrogateescape"), text)
        if text.startswith("/") and text not in out:
            out.append(text)
    return out
