"""Reading a snapshot back, verifying every chunk inside the same streaming pass.

Adjacent chunks of a file that sit next to each other in one pack are fetched with one
ranged read (up to 4 MiB), and ``prefetch`` reads are kept in flight ahead of the consumer, each
verified (BLAKE3 of every chunk) on the pool thread that read it, so a cold disk or a remote
bucket overlaps with hashing and hashing runs on several cores. :meth:`SnapshotReader.iter_file`
reads into a small ring of buffers reused across files (a fresh multi-MiB allocation per read
costs a page fault per 4 KiB), so memory stays at about ``prefetch`` × 4 MiB and a yielded chunk
is valid only until the next one is requested; :meth:`SnapshotReader.read_files_into` reads
straight into the caller's memory, with no copy; into page-aligned memory a local store reads
with ``O_DIRECT`` (:mod:`cairn.store.aligned`), which a restore into fresh memory gains from.
A delta chunk (:mod:`cairn.store.delta`) is read from its base's extent and its pages' and
checked once assembled; no byte of it is handed out or renamed into place before that.
In an encrypted store every stored extent is ``ciphertext || tag`` (:mod:`cairn.store.sealing`):
reads take in the tag into scratch memory of the pool thread that read it, each extent is
authenticated and decrypted from there into its place in the output (never in place: cryptography
51 refuses overlapping buffers, and out of place costs the same), and a chunk's name is checked
over its plaintext with the store's keyed hash.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import ConfigError, CorruptSnapshot, NotFound
from cairn.store.aligned import DIRECT_IO_ALIGN, aligned_buffer, cached_buffer
from cairn.store.backend import Backend
from cairn.store import delta
from cairn.store.confined import masked_mode, open_beneath
from cairn.store.fileops import OsFileOps, pwrite_all
from cairn.store.hashing import digest as plain_digest
from cairn.store.manifest import ChunkRef, FileEntry, Manifest
from cairn.store.sealing import TAG_BYTES, Sealer

MAX_READ_BYTES = 4 << 20
# A restore reads over holes up to this size between two chunks of a file in one pack: the
# newest snapshot of a key that changed in scattered places references its parents' packs with
# holes, and one sequential read of a span (holes included) beats a random read per 32 KiB
# chunk on a disk and a request per chunk on a bucket. Measured on a 512 MiB process image
# after 10% scattered page changes (4,705 chunk runs in 33 packs): 2.71 s read one run at a
# time; 1.53 s (2,213 reads, 654 MB) with 64 KiB holes, 1.41 s with 256 KiB (362 reads, 931 MB)
# or 1 MiB (252 reads, 988 MB): 256 KiB reads fewer extra bytes from a bucket.
RESTORE_MAX_GAP = 256 << 10
# A chunk that a file holds many times (deduplicated: zeroed or repeated memory) is read once
# for up to this many bytes of output, then again: one read per reference had an eager restore
# of 1 GiB of repeated memory from a GCS server take 58.8 s; this bound keeps a few such reads
# in flight at once, as for any other file.
RESTORE_MAX_REPEAT_BYTES = 64 << 20
_OS = OsFileOps()


@dataclass(frozen=True)
class _Part:
    """``size`` stored bytes of ``pack`` at ``offset``. ``digest`` is checked when the part is
    read; it is empty for a piece of a delta chunk, which is checked once assembled."""

    digest: str
    size: int
    pack: str
    offset: int
    chunk: ChunkRef | None = None  # the delta chunk whose pages (or base) these are


@dataclass(frozen=True)
class _Range:
    pack: str
    offset: int
    length: int
    chunks: tuple[ChunkRef | _Part, ...]
    assemble: bool = False  # one delta chunk, read from its two extents and then checked


def _coalesce(chunks: tuple[ChunkRef, ...], tail: int = 0) -> list[_Range]:
    """Reads of ``chunks`` in file order; ``tail``: the bytes stored after each extent (an
    encrypted store's tag)."""
    ranges: list[_Range] = []
    run: list[ChunkRef] = []
    for chunk in chunks:
        if chunk.is_delta:
            if run:
                ranges.append(_make_range(run, tail))
                run = []
            ranges.append(_Range(chunk.pack, chunk.offset, chunk.size + tail, (chunk,),
                                 assemble=True))
            continue
        if run:
            last = run[-1]
            end = last.offset + last.size + tail
            contiguous = chunk.pack == last.pack and chunk.offset == end
            # The limit is on the chunks' bytes: tags make a range a little longer.
            payload = end - run[0].offset - len(run) * tail + chunk.size
            if contiguous and payload <= MAX_READ_BYTES:
                run.append(chunk)
                continue
            ranges.append(_make_range(run, tail))
        run = [chunk]
    if run:
        ranges.append(_make_range(run, tail))
    return ranges


@dataclass(frozen=True)
class _Span(_Range):
    """A ranged read for a restore: ``length`` bytes of ``pack`` at ``offset`` holding
    ``chunks`` (at ``chunk.offset - offset`` each, with gaps of other snapshots' bytes between
    them), the i-th chunk's bytes going to ``positions[i]`` of the output."""

    positions: tuple[int, ...] = ()

    @property
    def payload(self) -> int:
        return sum(chunk.size for chunk in self.chunks)

    def pieces(self) -> Iterator[tuple[int, int, int]]:
        """``(start in the read buffer, length, output position)`` of each run of chunks
        adjacent both in the pack and in the output."""
        start = length = position = -1
        for chunk, at in zip(self.chunks, self.positions):
            here = chunk.offset - self.offset
            if start >= 0 and here == start + length and at == position + length:
                length += chunk.size
                continue
            if start >= 0:
                yield start, length, position
            start, length, position = here, chunk.size, at
        if start >= 0:
            yield start, length, position


def _spans(parts: Sequence[tuple[_Part, int]], *, max_gap: int = RESTORE_MAX_GAP,
           tail: int = 0) -> list[_Span]:
    """The reads that fetch ``parts``, each to land at its position in the output: grouped by
    pack and read in pack order, a span taking in gaps of up to ``max_gap`` bytes, at most
    MAX_READ_BYTES long. The newest snapshot of a key that changed in scattered places
    alternates, chunk by chunk, between its parents' packs and its own: in file order no two
    neighbours share a pack, in pack order they lie a few holes apart. A part the output needs
    at several positions is read once for up to RESTORE_MAX_REPEAT_BYTES of them."""
    by_pack: dict[str, list[tuple[_Part, int]]] = {}
    for part, position in parts:
        by_pack.setdefault(part.pack, []).append((part, position))
    spans: list[_Span] = []
    for pack, members in by_pack.items():  # packs in the order the output first needs them
        members.sort(key=lambda m: (m[0].offset, m[1]))
        run: list[tuple[_Part, int]] = []
        repeated = 0  # bytes of output the run's last part fills beyond its first position
        for part, at in members:
            if run:
                first, last = run[0][0], run[-1][0]
                if part.offset == last.offset and part.size == last.size:
                    if repeated + part.size <= RESTORE_MAX_REPEAT_BYTES:
                        repeated += part.size
                        run.append((part, at))
                        continue
                else:
                    gap = part.offset - (last.offset + last.size)
                    if (0 <= gap <= max_gap
                            and part.offset + part.size + tail - first.offset <= MAX_READ_BYTES):
                        repeated = 0
                        run.append((part, at))
                        continue
                spans.append(_make_span(pack, run, tail))
            run, repeated = [(part, at)], 0
        if run:
            spans.append(_make_span(pack, run, tail))
    return spans


@dataclass(frozen=True)
class _Plan:
    """How a restore reads a run of chunks: ``direct`` parts go to their output position as
    read (a full chunk, verified as read; a delta chunk's base, checked later); each of
    ``deltas`` is a delta chunk, its output position and the part holding its pages."""

    direct: list[tuple[_Part, int]]
    deltas: list[tuple[ChunkRef, int, _Part]]


def _plan(chunks: Sequence[ChunkRef]) -> _Plan:
    plan = _Plan([], [])
    position = 0
    for chunk in chunks:
        if chunk.is_delta:
            assert chunk.base_pack is not None
            plan.direct.append((_Part("", chunk.size, chunk.base_pack, chunk.base_offset, chunk),
                                position))
            plan.deltas.append((chunk, position, _Part("", chunk.stored_size, chunk.pack,
                                                       chunk.offset, chunk)))
        else:
            plan.direct.append((_Part(chunk.digest, chunk.size, chunk.pack, chunk.offset),
                                position))
        position += chunk.size
    return plan


def _bad_chunk(chunk: ChunkRef, seq: int) -> CorruptSnapshot:
    where = f"{chunk.pack}" if not chunk.is_delta else f"{chunk.pack} (base in {chunk.base_pack})"
    return CorruptSnapshot(f"chunk {chunk.digest} in {where} does not match its digest",
                           seq=seq, digest=chunk.digest)


def _make_span(pack: str, run: list[tuple[_Part, int]], tail: int = 0) -> _Span:
    # Widened to whole 4 KiB blocks, so that a local store reads the span with O_DIRECT into
    # aligned memory (no page-cache copy, and no page cache to allocate: ADR 0016, 0021).
    start = run[0][0].offset // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
    end = max(chunk.offset + chunk.size + tail for chunk, _ in run)
    end = -(-end // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
    return _Span(pack, start, end - start, tuple(c for c, _ in run),
                 positions=tuple(at for _, at in run))


# What one span may need: MAX_READ_BYTES of chunks, widened by a block at either end.
SPAN_BUFFER_BYTES = MAX_READ_BYTES + 2 * DIRECT_IO_ALIGN


_SCRATCH = threading.local()


def _thread_scratch(length: int, *, slot: int = 0) -> memoryview:
    """Page-aligned memory of ``length`` bytes. Up to SPAN_BUFFER_BYTES it is reused by the
    calling (pool) thread (a fresh mapping per read would fault in every page of it: 0.44 s
    per GiB here); a longer one (a chunk above MAX_READ_BYTES) is the caller's own, so that no
    thread keeps it. Each ``slot`` (0 or 1) is a buffer of its own, for a read staged in one
    and decrypted into the other."""
    if length > SPAN_BUFFER_BYTES:
        return memoryview(aligned_buffer(length))
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = [None, None]
    if buffers[slot] is None:
        buffers[slot] = aligned_buffer(SPAN_BUFFER_BYTES)
    return memoryview(buffers[slot])[:length]


def _take_buffer(free: list[memoryview], length: int) -> memoryview:
    # Never page-aligned: a local streaming read keeps the page cache and its readahead.
    # Into reused buffers O_DIRECT measured no faster (ADR 0016).
    while free:
        buffer = free.pop()
        if len(buffer) >= length:
            return buffer
    return cached_buffer(max(length, MAX_READ_BYTES))


def _make_range(run: list[ChunkRef], tail: int = 0) -> _Range:
    start = run[0].offset
    return _Range(run[0].pack, start, run[-1].offset + run[-1].size + tail - start, tuple(run))


class SnapshotReader:
    """Reads files of one committed snapshot. One thread uses a reader at a time."""

    def __init__(self, backend: Backend, manifest: Manifest, *, pool: ThreadPoolExecutor,
                 prefetch: int = 4, sealer: Sealer | None = None) -> None:
        self.backend = backend
        self.manifest = manifest
        self._sealer = sealer
        self._tail = TAG_BYTES if sealer is not None else 0
        self._digest = sealer.digest if sealer is not None else plain_digest
        self._pool = pool
        self._prefetch = max(1, prefetch)
        self._free: list[memoryview] = []  # iter_file's read buffers, reused across files

    def _read_part(self, pack: str, offset: int, view: memoryview, digest: str) -> int:
        try:
            return self.backend.read_range_into(pack, offset, view)
        except NotFound:
            raise CorruptSnapshot(
                f"chunk {digest or '(part of a delta chunk)'} is missing: its pack {pack} "
                "does not exist", seq=self.manifest.seq, digest=digest or None) from None

    def _fetch_delta(self, chunk: ChunkRef, view: memoryview) -> int:
        """Read delta ``chunk``'s base and pages, assemble it in ``view[:chunk.size]`` (nothing
        of ``view`` past that is written) and check its digest."""
        assert chunk.base_pack is not None
        pages = aligned_buffer(-(-chunk.stored_size // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN)
        self._fetch_extent(chunk.base_pack, chunk.base_offset, view[:chunk.size], chunk)
        self._fetch_extent(chunk.pack, chunk.offset, memoryview(pages)[:chunk.stored_size], chunk)
        delta.apply(view[:chunk.size], memoryview(pages), chunk.delta_mask)
        if self._digest(view[:chunk.size]) != chunk.digest:
            raise _bad_chunk(chunk, self.manifest.seq)
        return chunk.size

    def _fetch_extent(self, pack: str, offset: int, out: memoryview, chunk: ChunkRef) -> None:
        """Read one stored extent of delta ``chunk`` (its base or its pages) and put its
        plaintext in ``out`` (exactly its size); checked once the chunk is assembled."""
        sealed = _thread_scratch(len(out) + self._tail) if self._tail else out
        if self._read_part(pack, offset, sealed, chunk.digest) < len(sealed):
            raise CorruptSnapshot(f"delta chunk {chunk.digest} in {chunk.pack} is truncated",
                                  seq=self.manifest.seq, digest=chunk.digest)
        if self._tail:
            self._open(pack, offset, sealed, chunk.digest, out)

    def _open(self, pack: str, offset: int, sealed: memoryview, digest: str,
              out: memoryview) -> None:
        """Authenticate and decrypt one stored extent (an encrypted store) into ``out``. A
        failure names the chunk ``digest``."""
        assert self._sealer is not None
        try:
            self._sealer.open_extent_into(pack, offset, sealed, out)
        except CorruptSnapshot as e:
            raise type(e)(f"chunk {digest}: {e}", seq=self.manifest.seq,
                          digest=digest or None) from None

    def _fetch_to(self, rng: _Range, target: memoryview) -> int:
        """:meth:`_fetch_verified` into ``target``, which holds exactly the chunks' plaintext,
        back to back."""
        return self._fetch_verified(rng, target, packed=True)

    def _fetch_verified(self, rng: _Range, view: memoryview, *, packed: bool = False,
                        staging: memoryview | None = None) -> int:
        """Read ``rng`` and check the digest of every chunk that has one (a delta chunk's
        pieces are checked once assembled); runs on a pool thread. Each chunk's plaintext goes
        to its offset in the range within ``view`` (at least ``rng.length`` bytes; what lies
        between chunks is undefined), or with ``packed`` back to back from the start of
        ``view``. An encrypted store's extents are read into ``staging`` (at least
        ``rng.length`` bytes, not overlapping ``view``; by default the thread's page-aligned
        scratch memory, which a local backend reads with ``O_DIRECT``) and decrypted from
        there. Returns the bytes read."""
        if rng.assemble:
            chunk = rng.chunks[0]
            assert isinstance(chunk, ChunkRef)
            return self._fetch_delta(chunk, view)
        tail = self._tail
        # Unsealed, a packed range is one contiguous run: read in place either way.
        assert tail or not packed or rng.length == sum(c.size for c in rng.chunks)
        if not tail:
            stored = view[:rng.length]
        elif staging is None:
            stored = _thread_scratch(rng.length)
        else:
            stored = staging[:rng.length]
        got = self._read_part(rng.pack, rng.offset, stored, rng.chunks[0].digest)
        at = 0
        previous = -1
        for chunk in rng.chunks:
            start = chunk.offset - rng.offset
            if start == previous and not packed:
                continue  # the same extent again, for another output position (a _Span)
            previous = start
            if start + chunk.size + tail > got:
                raise CorruptSnapshot(
                    f"chunk {chunk.digest or '(part of a delta chunk)'} in {chunk.pack} is "
                    f"truncated ({max(got - start - tail, 0)} of {chunk.size} bytes)",
                    seq=self.manifest.seq, digest=chunk.digest or None)
            out = view[at:at + chunk.size] if packed else view[start:start + chunk.size]
            at += chunk.size
            if tail:
                owner = chunk.chunk if isinstance(chunk, _Part) and chunk.chunk else chunk
                self._open(chunk.pack, chunk.offset, stored[start:start + chunk.size + tail],
                           owner.digest, out)
            if chunk.digest and self._digest(out) != chunk.digest:
                raise CorruptSnapshot(
                    f"chunk {chunk.digest} in {chunk.pack} does not match its digest",
                    seq=self.manifest.seq, digest=chunk.digest)
        return at if packed else got

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
        ranges = _coalesce(entry.chunks, self._tail)
        free = self._free
        pending: deque[tuple[_Range, memoryview, memoryview | None, Future[int]]] = deque()
        next_index = 0
        try:
            for _ in ranges:
                while next_index < len(ranges) and len(pending) < self._prefetch:
                    rng = ranges[next_index]
                    next_index += 1
                    buffer = _take_buffer(free, rng.length)
                    # A sealed range is staged in such a buffer as well, not the thread's
                    # aligned scratch, which a local backend reads with O_DIRECT: a streamed
                    # read keeps the page cache and its readahead (ADR 0016, ADR 0038).
                    staging = _take_buffer(free, rng.length) if self._tail else None
                    pending.append((rng, buffer, staging, self._pool.submit(
                        self._fetch_verified, rng, buffer, staging=staging)))
                rng, buffer, staging, future = pending.popleft()
                future.result()
                if staging is not None:
                    free.append(staging)
                for chunk in rng.chunks:
                    start = chunk.offset - rng.offset
                    if progress is not None:
                        progress(chunk.size)
                    yield buffer[start:start + chunk.size]
                free.append(buffer)  # only once its read is done and its pieces consumed
        finally:
            for _, _, _, future in pending:
                future.cancel()  # a read still running owns its buffers, which are dropped

    def read_files_into(self, targets: Sequence[tuple[str, memoryview]], *,
                        progress: Callable[[int], None] | None = None) -> None:
        """Read whole files straight into caller-given writable buffers, one per path and
        exactly the file's size, every chunk verified.

        One pipeline runs across all the files: up to ``prefetch`` ranged reads in flight,
        each hashed on the pool thread that read it. Returns once every byte is in place and
        verified. Raises :class:`CorruptSnapshot` (naming the chunk) at the first bad chunk,
        after every read already started has ended; the buffers' contents are then undefined.
        """
        entries = {entry.path: entry for entry in self.manifest.files}
        work: list[tuple[_Range, memoryview]] = []
        for path, buffer in targets:
            entry = entries[path]
            view = memoryview(buffer).cast("B")
            if view.readonly or len(view) != entry.size:
                raise ValueError(f"{path}: need a writable buffer of {entry.size} bytes, got "
                                 f"{'a read-only one' if view.readonly else f'{len(view)} bytes'}")
            position = 0
            for rng in _coalesce(entry.chunks, self._tail):
                payload = sum(chunk.size for chunk in rng.chunks)
                work.append((rng, view[position:position + payload]))
                position += payload
            if position != entry.size:
                raise CorruptSnapshot(f"{path}: its chunks add up to {position} bytes, not "
                                      f"{entry.size}", seq=self.manifest.seq)
        # Each read has its own target, so reads finish in any order: a new one starts as
        # soon as any ends, not when the oldest does. Waiting on the oldest left pool threads
        # idle behind one slow read (a fresh page's fault waits on the hypervisor on a VM):
        # 1.5 GB cold, 8 threads: 1.13-1.18 s, and 1.03-1.07 s with the pool kept full (ADR 0036).
        pending: dict[Future[int], _Range] = {}
        next_index = 0
        try:
            while next_index < len(work) or pending:
                while next_index < len(work) and len(pending) < self._prefetch:
                    rng, view = work[next_index]
                    next_index += 1
                    pending[self._pool.submit(self._fetch_to, rng, view)] = rng
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    rng = pending.pop(future)
                    future.result()
                    if progress is not None:
                        progress(sum(chunk.size for chunk in rng.chunks))
        finally:
            _settle(list(pending))

    def read_chunks(self, chunks: Sequence[ChunkRef], *,
                    into: memoryview | None = None) -> bytearray | memoryview:
        """The verified bytes of ``chunks`` (consecutive chunks of one file), concatenated;
        ranged reads run on the pool, up to ``prefetch`` at once. Raises
        :class:`CorruptSnapshot` (naming the chunk) when one does not match its digest; no
        byte of a bad chunk is ever returned.

        ``into``: writable memory of at least the chunks' size to fill and return (its first
        that many bytes), for a caller that reads run after run into the same memory; by
        default a new bytearray. After a raise its contents are undefined, and no read still
        writes into it."""
        plan = _plan(chunks)
        total = sum(chunk.size for chunk in chunks)
        if into is None:
            result: bytearray | memoryview = bytearray(total)
        else:
            result = memoryview(into).cast("B")[:total]
            if result.readonly or len(result) < total:
                raise ValueError(f"need {total} writable bytes to read into, got "
                                 f"{'read-only memory' if result.readonly else len(result)}")
        out = memoryview(result)
        pages_at: list[int] = []
        position = 0
        for _, _, part in plan.deltas:
            pages_at.append(position)
            position += part.size
        pages = bytearray(position)  # every delta chunk's changed pages, one after another
        work = [(span, out) for span in _spans(plan.direct, tail=self._tail)]
        work += [(span, memoryview(pages))
                 for span in _spans([(part, at) for (_, _, part), at
                                     in zip(plan.deltas, pages_at)], tail=self._tail)]
        futures = [self._pool.submit(self._fetch_span, span, target) for span, target in work]
        try:
            for future in futures:
                future.result()
        finally:
            _settle(futures)
        for (chunk, at, part), page_at in zip(plan.deltas, pages_at):
            assembled = out[at:at + chunk.size]
            delta.apply(assembled, memoryview(pages)[page_at:page_at + part.size],
                        chunk.delta_mask)
            if self._digest(assembled) != chunk.digest:
                raise _bad_chunk(chunk, self.manifest.seq)
        return result

    def _fetch_span(self, span: _Span, target: memoryview) -> int:
        """Read ``span`` into this pool thread's scratch memory, verify it and copy its
        chunks to their positions in ``target``. Reused scratch, not a buffer per read: fresh
        memory faults in every page (a 1 GiB streamed restore spent 0.9 s of its 1.5 s in
        the kernel, most of it so)."""
        staged = _thread_scratch(span.length, slot=1)
        self._fetch_verified(span, staged)
        for start, length, at in span.pieces():  # verified; the chunks, not the gaps
            target[at:at + length] = staged[start:start + length]
        return span.payload

    def read_file(self, path: str) -> bytes:
        """The whole verified file (for small files; use :meth:`iter_file` for big ones)."""
        return b"".join(bytes(piece) for piece in self.iter_file(path))

    def verify(self, *, progress: Callable[[int], None] | None = None) -> None:
        """Read and check every chunk; raises :class:`CorruptSnapshot` at the first bad one."""
        for entry in self.manifest.files:
            for _ in self._iter_entry(entry, progress):
                pass

    def restore_to(self, dest: str | os.PathLike[str], *, durable: bool = True,
                   exclude: Collection[str] = (),
                   progress: Callable[[int], None] | None = None) -> None:
        """Write every file under ``dest``, all or nothing.

        Files go to a temporary sibling directory that replaces ``dest`` (which must not
        exist, or be an empty directory) only after every chunk verified. With ``durable``
        every file and directory is fsynced before that rename, so a power loss never leaves a
        ``dest`` that looks complete; without it (a restore's scratch copy, deleted once read)
        the files are only as durable as the page cache. Modes are masked to 0o777 (no setuid,
        setgid or sticky bit) and owners are never changed: a file belongs to whoever
        restores it. Files whose manifest path is in ``exclude`` are left out (a lazy restore
        fetches them chunk by chunk, :mod:`cairn.process.lazy`).

        One pipeline runs across all the files: up to ``prefetch`` ranged reads in flight (a
        file's chunks grouped by pack, each read spanning holes of up to RESTORE_MAX_GAP),
        each verified and its chunks written at their offsets (``pwrite``) on the pool thread
        that read it,
        so reading, hashing and writing overlap and use every core. At most ``prefetch`` + 1
        files without delta chunks are open at once; a file with delta chunks stays open
        until its pages are patched in, after every other file's first pass.
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
                directories.add(os.path.dirname(os.path.join(partial, *entry.path.split("/"))))
            self._write_files(partial, durable=durable, exclude=frozenset(exclude),
                              progress=progress)
            if durable:
                for directory in sorted(directories, key=len, reverse=True):
                    _OS.fsync_dir(directory)
            if os.path.isdir(dest):
                os.rmdir(dest)
            os.rename(partial, dest)
            if durable:
                _OS.fsync_dir(parent)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def _write_files(self, root: str, *, durable: bool, exclude: frozenset[str],
                     progress: Callable[[int], None] | None) -> None:
        """Create every file of the manifest under ``root`` with its verified content (see
        :meth:`restore_to`). Returns once every write has ended; raises the first error.

        Two passes: the first writes every full chunk (verified as read) and every delta
        chunk's base; the second reads the deltas' pages (stored together in the newer
        packs), patches each delta chunk in place and checks its digest over the assembled
        bytes read back from the file. A bad delta chunk fails the restore like any other, and
        nothing is renamed into place before both passes end."""
        buffers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(self._prefetch):
            buffers.put(aligned_buffer(SPAN_BUFFER_BYTES))
        pending: deque[tuple[_OpenFile, int, Future[None]]] = deque()

        def read_span(rng: _Span, out: _OpenFile, write: Callable[[_Span, memoryview, int], None]
                      ) -> None:
            buffer = buffers.get()  # one is free: no more than prefetch tasks are in flight
            try:
                # A chunk above MAX_READ_BYTES (max_chunk_bytes allows up to 256 MiB) is a
                # range of its own, read into memory of its size.
                view = memoryview(buffer if len(buffer) >= rng.length
                                  else aligned_buffer(rng.length))
                self._fetch_verified(rng, view)
                assert out.fd is not None
                write(rng, view, out.fd)
            finally:
                buffers.put(buffer)

        def write_direct(rng: _Span, view: memoryview, fd: int) -> None:
            for start, length, at in rng.pieces():  # the chunks, not the gaps
                pwrite_all(fd, view[start:start + length], at)

        def write_patched(rng: _Span, view: memoryview, fd: int) -> None:
            scratch = bytearray(max(part.chunk.size for part in rng.chunks  # type: ignore[union-attr]
                                    ))
            for part, at in zip(rng.chunks, rng.positions):
                chunk = part.chunk
                assert isinstance(part, _Part) and chunk is not None
                assembled = memoryview(scratch)[:chunk.size]
                got = os.preadv(fd, [assembled], at)  # the base, written by the first pass
                start = part.offset - rng.offset
                pages = view[start:start + part.size]
                delta.apply(assembled, pages, chunk.delta_mask)
                if got != chunk.size or self._digest(assembled) != chunk.digest:
                    raise _bad_chunk(chunk, self.manifest.seq)
                for page, taken in delta.positions(chunk.delta_mask):  # only what changed
                    pwrite_all(fd, pages[taken:taken + delta.DELTA_PAGE],
                               at + page * delta.DELTA_PAGE)

        def submit(out: _OpenFile, span: _Span, write: Callable[[_Span, memoryview, int], None],
                   counted: int) -> None:
            while len(pending) >= self._prefetch:
                finish_oldest()
            out.outstanding += 1
            pending.append((out, counted, self._pool.submit(read_span, span, out, write)))

        def finish_oldest() -> None:
            out, counted, future = pending.popleft()
            future.result()
            if progress is not None and counted:
                progress(counted)
            out.outstanding -= 1
            if out.outstanding == 0 and out.submitted:
                out.close(durable=durable)

        opened: list[_OpenFile] = []
        patches: list[tuple[_OpenFile, list[_Span]]] = []
        try:
            for entry in self.manifest.files:
                if entry.path in exclude:
                    continue
                # Confined (no symlink, no '..'), created exclusively, mode without setuid
                # bits: a restore may run as root, and the manifest came from a shared store.
                out = _OpenFile(open_beneath(root, entry.path,
                                             flags=os.O_RDWR | os.O_CREAT | os.O_EXCL,
                                             mode=0o600), entry)
                opened.append(out)
                total = sum(chunk.size for chunk in entry.chunks)
                if total != entry.size:
                    raise CorruptSnapshot(f"{entry.path}: its chunks add up to {total} "
                                          f"bytes, not {entry.size}", seq=self.manifest.seq)
                plan = _plan(entry.chunks)
                for span in _spans(plan.direct, tail=self._tail):
                    submit(out, span, write_direct, span.payload)
                if plan.deltas:
                    patches.append((out, _spans([(part, at) for _, at, part in plan.deltas],
                                                tail=self._tail)))
                    continue
                out.submitted = True
                if out.outstanding == 0:
                    out.close(durable=durable)
            while pending:  # every base is written before any delta is patched over it
                finish_oldest()
            for out, spans in patches:
                for span in spans:
                    submit(out, span, write_patched, 0)
                out.submitted = True
                if out.outstanding == 0:
                    out.close(durable=durable)
            while pending:
                finish_oldest()
        finally:
            # Nothing may still write into a file once this returns or raises.
            _settle([future for _, _, future in pending])
            for out in opened:
                out.abandon()


def _settle(futures: Sequence[Future[Any]]) -> None:
    """Cancel what has not started and wait for the rest: nothing may still write into the
    caller's memory or files once a read returns or raises."""
    for future in futures:
        future.cancel()
    for future in futures:
        if not future.cancelled():
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the first error is being raised
                pass


class _OpenFile:
    """A file :meth:`SnapshotReader.restore_to` is writing: its descriptor and how many of
    its ranges are still in flight. Touched only by the thread running the restore."""

    def __init__(self, fd: int, entry: FileEntry) -> None:
        self.fd: int | None = fd
        self.entry = entry
        self.outstanding = 0
        self.submitted = False

    def close(self, *, durable: bool) -> None:
        fd, self.fd = self.fd, None
        assert fd is not None
        try:
            if self.entry.mode is not None:
                os.fchmod(fd, masked_mode(self.entry.mode, path=self.entry.path))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def abandon(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

