"""Reading a snapshot back, verifying every chunk inside the same streaming pass.

Adjacent chunks of a file that sit next to each other in one pack are fetched with one
ranged read (up to 4 MiB), and ``prefetch`` reads are kept in flight ahead of the consumer, so
a cold disk or a remote bucket overlaps with hashing. Reads land in a small ring of reused
buffers (a fresh multi-MiB allocation per read costs a page fault per 4 KiB), so memory stays at
about ``prefetch`` × 4 MiB, and a yielded chunk is valid only until the next one is requested.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cairn.exceptions import ConfigError, CorruptSnapshot, NotFound
from cairn.store.backend import Backend
from cairn.store.fileops import OsFileOps
from cairn.store.hashing import digest as compute_digest
from cairn.store.manifest import ChunkRef, FileEntry, Manifest

MAX_READ_BYTES = 4 << 20
_OS = OsFileOps()


@dataclass(frozen=True)
class _Range:
    pack: str
    offset: int
    length: int
    chunks: tuple[ChunkRef, ...]


def _coalesce(chunks: tuple[ChunkRef, ...]) -> list[_Range]:
    ranges: list[_Range] = []
    run: list[ChunkRef] = []
    for chunk in chunks:
        if run:
            last = run[-1]
            contiguous = chunk.pack == last.pack and chunk.offset == last.offset + last.size
            if contiguous and (last.offset + last.size - run[0].offset + chunk.size) <= MAX_READ_BYTES:
                run.append(chunk)
                continue
            ranges.append(_make_range(run))
        run = [chunk]
    if run:
        ranges.append(_make_range(run))
    return ranges


def _take_buffer(free: list[bytearray], length: int) -> bytearray:
    while free:
        buffer = free.pop()
        if len(buffer) >= length:
            return buffer
    return bytearray(max(length, MAX_READ_BYTES))


def _make_range(run: list[ChunkRef]) -> _Range:
    start = run[0].offset
    return _Range(run[0].pack, start, run[-1].offset + run[-1].size - start, tuple(run))


class SnapshotReader:
    """Reads files of one committed snapshot. Each method may be used from one thread."""

    def __init__(self, backend: Backend, manifest: Manifest, *, pool: ThreadPoolExecutor,
                 prefetch: int = 4) -> None:
        self.backend = backend
        self.manifest = manifest
        self._pool = pool
        self._prefetch = max(1, prefetch)

    def _fetch_into(self, rng: _Range, buffer: bytearray) -> int:
        try:
            return self.backend.read_range_into(rng.pack, rng.offset, memoryview(buffer)[:rng.length])
        except NotFound:
            first = rng.chunks[0]
            raise CorruptSnapshot(
                f"chunk {first.digest} is missing: its pack {rng.pack} does not exist",
                seq=self.manifest.seq, digest=first.digest) from None

    def iter_file(self, path: str, *, progress: Callable[[int], None] | None = None
                  ) -> Iterator[memoryview]:
        """Yield the file's bytes chunk by chunk, each verified before it is yielded.

        A yielded view is valid only until the next one is requested (copy it to keep it).
        Raises :class:`CorruptSnapshot` (naming the chunk) at the first bad chunk.
        """
        entry = self.manifest.file(path)
        yield from self._iter_entry(entry, progress)

    def _iter_entry(self, entry: FileEntry, progress: Callable[[int], None] | None
                    ) -> Iterator[memoryview]:
        ranges = _coalesce(entry.chunks)
        free: list[bytearray] = []
        pending: deque[tuple[_Range, bytearray, Future[int]]] = deque()
        next_index = 0
        try:
            for _ in ranges:
                while next_index < len(ranges) and len(pending) < self._prefetch:
                    rng = ranges[next_index]
                    next_index += 1
                    buffer = _take_buffer(free, rng.length)
                    pending.append((rng, buffer, self._pool.submit(self._fetch_into, rng, buffer)))
                rng, buffer, future = pending.popleft()
                got = future.result()
                data = memoryview(buffer)[:got]
                for chunk in rng.chunks:
                    start = chunk.offset - rng.offset
                    piece = data[start:start + chunk.size]
                    if len(piece) != chunk.size:
                        raise CorruptSnapshot(
                            f"chunk {chunk.digest} in {chunk.pack} is truncated "
                            f"({len(piece)} of {chunk.size} bytes)",
                            seq=self.manifest.seq, digest=chunk.digest)
                    if compute_digest(piece) != chunk.digest:
                        raise CorruptSnapshot(
                            f"chunk {chunk.digest} in {chunk.pack} does not match its digest",
                            seq=self.manifest.seq, digest=chunk.digest)
                    if progress is not None:
                        progress(chunk.size)
                    yield piece
                free.append(buffer)
        finally:
            for _, _, future in pending:
                future.cancel()

    def read_file(self, path: str) -> bytes:
        """The whole verified file (for small files; use :meth:`iter_file` for big ones)."""
        return b"".join(bytes(piece) for piece in self.iter_file(path))

    def verify(self, *, progress: Callable[[int], None] | None = None) -> None:
        """Read and check every chunk; raises :class:`CorruptSnapshot` at the first bad one."""
        for entry in self.manifest.files:
            for _ in self._iter_entry(entry, progress):
                pass

    def restore_to(self, dest: str | os.PathLike[str], *,
                   progress: Callable[[int], None] | None = None) -> None:
        """Write every file under ``dest``, all or nothing, durable when this returns.

        Files go to a temporary sibling directory that replaces ``dest`` (which must not
        exist, or be an empty directory) only after every chunk verified and every file and
        directory was fsynced, so a power loss never leaves a ``dest`` that looks complete.
        """
        dest = os.path.abspath(dest)
        if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
            raise ConfigError(f"restore destination {dest!r} exists and is not empty; "
                              "give a new or empty directory")
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        partial = os.path.join(parent, f".{os.path.basename(dest)}.cairn-partial-{uuid.uuid4().hex[:8]}")
        os.mkdir(partial)
        directories = {partial}
        try:
            for entry in self.manifest.files:
                target = os.path.join(partial, *entry.path.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                directories.add(os.path.dirname(target))
                with open(target, "wb") as out:
                    for piece in self._iter_entry(entry, progress):
                        out.write(piece)
                    out.flush()
                    if entry.mode is not None:
                        os.fchmod(out.fileno(), entry.mode)
                    os.fsync(out.fileno())
            for directory in sorted(directories, key=len, reverse=True):
                _OS.fsync_dir(directory)
            if os.path.isdir(dest):
                os.rmdir(dest)
            os.rename(partial, dest)
            _OS.fsync_dir(parent)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
