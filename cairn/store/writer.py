"""SnapshotWriter: stream files into chunks and packs, then commit one ``snap`` record.

Nothing a writer does is visible to readers until :meth:`SnapshotWriter.commit` creates the
``snap`` record, which happens only after every pack it references is durable. A crash at any
earlier point leaves at most unreferenced packs, which garbage collection removes.

Dedup is only against the parent snapshot's chunks and chunks this attempt wrote itself. A
reused chunk's pack is *touched* before the reference is recorded: garbage collection never
deletes a pack touched within its grace period, and its version-guarded delete loses to a
touch that races it. A touch that finds the pack gone means the chunk is written again. On a
backend whose deletes a touch cannot guard (S3), a pack garbage collection has condemned is
not reused at all (:mod:`cairn.store.condemned`).

A file added with ``locators`` (a process image's pages: where each chunk sits in the address
space) may have a changed chunk stored as a page delta against the full chunk the attempt's
previous snapshot had at the same locator (:mod:`cairn.store.delta`); its base's pack is
touched like a reused chunk's.
"""

from __future__ import annotations

import logging
import os
import platform
import stat
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Callable, Protocol

from cairn.exceptions import ConfigError, NotFound, SnapshotTooSlow
from cairn.store import delta
from cairn.store.chunking import chunk_spans, segments
from cairn.store.condemned import condemned_packs
from cairn.store.manifest import (
    ChunkRef,
    FileEntry,
    Manifest,
    SnapshotMode,
    check_relative_path,
)
from cairn.store.backend import Backend
from cairn.store.delta import DeltaState
from cairn.store.keys import Key
from cairn.store.packs import PackWriter
from cairn.store.read_ahead import WINDOW_BYTES, PlannedChunk, ReadAhead
from cairn.store.sealing import Sealer
from cairn.store.settings import StoreSettings
from cairn.store.slotlog import AttemptLog, RecordKind, writer_identity
from cairn.store.timestamps import format_timestamp
from cairn.version import __version__

# A stream of known size at least this long is read a window ahead on a thread of its own.
READ_AHEAD_MIN_BYTES = 2 * WINDOW_BYTES

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int], None]


class WriterStore(Protocol):
    """What a snapshot writer uses of its store (:class:`cairn.store.Store` is one)."""

    settings: StoreSettings
    backend: Backend
    pool: ThreadPoolExecutor
    sealer: Sealer | None
    gc_grace_seconds: float

    def chunk_digest(self, data: bytes | bytearray | memoryview) -> str: ...


class WriterAttempt(Protocol):
    """What a snapshot writer uses of its attempt (:class:`cairn.store.attempt.Attempt`)."""

    key: Key
    log: AttemptLog
    known_chunks: dict[str, ChunkRef]
    deltas: DeltaState

    @property
    def store(self) -> WriterStore: ...

    @property
    def epoch(self) -> int: ...

    def forget_pack(self, pack: str) -> None: ...

    def committed(self, manifest: Manifest) -> None: ...

    def publish_part(self, manifest: Manifest, *, rank: int) -> None: ...

    def remember(self, manifest: Manifest) -> None: ...


@dataclass
class WriteStats:
    bytes_logical: int = 0
    bytes_written: int = 0
    chunks_total: int = 0
    chunks_reused: int = 0
    chunks_delta: int = 0  # stored as changed pages over a base chunk


class SnapshotWriter:
    """Builds one snapshot of an attempt. One thread uses it; use as a context manager.

    Leaving the ``with`` block without :meth:`commit` aborts (nothing is committed).
    """

    def __init__(self, attempt: WriterAttempt, *, mode: SnapshotMode, parent: Manifest | None,
                 progress: ProgressCallback | None = None, last: bool = False) -> None:
        """``last``: no later snapshot of this attempt will follow (a final snapshot before
        the try ends), so the page hashes that would let the next one store changed chunks
        as deltas are not computed (~0.4 s of a 2 GiB image). Deltas against the parent are
        still used."""
        self._attempt = attempt
        self._last = last
        self._store = attempt.store
        settings = self._store.settings
        self._max_chunk = settings.max_chunk_bytes
        self._mode = mode
        self._parent = parent
        self._progress = progress
        self._files: dict[str, FileEntry] = {}
        self._fresh_packs: set[str] = set()
        self._condemned_packs: frozenset[str] | None = None
        self._packs = PackWriter(
            self._store.backend,
            pack_bytes=settings.pack_bytes,
            pool=self._store.pool,
            max_inflight=settings.max_inflight_packs,
            sealer=self._store.sealer,
        )
        self._started = time.monotonic()
        self._closed = False
        # locator -> the full chunk that the next snapshot's chunk there may be a delta of,
        # and the base of every delta chunk this snapshot references
        self._bases: dict[Hashable, ChunkRef] = {}
        self._delta_bases: dict[str, ChunkRef] = {}
        self.stats = WriteStats()

    # -- adding data ---------------------------------------------------------------------

    def add_bytes(self, path: str, data: bytes | bytearray | memoryview, *,
                  cuts: Iterable[int] = (), mode: int | None = None,
                  locators: Sequence[Hashable] | None = None) -> FileEntry:
        """Add a file from a buffer; ``cuts`` are offsets where a chunk must begin
        (``locators`` as for :meth:`add_stream`)."""
        self._check_new_path(path)
        view = memoryview(data).cast("B")
        cuts = list(cuts)
        by_start = _by_start(path, cuts, locators)
        chunks = []
        for start, end in segments(len(view), cuts):
            for index, (offset, stop) in enumerate(chunk_spans(end - start,
                                                               max_chunk=self._max_chunk)):
                locator = (path, by_start[start], index) if start in by_start else None
                chunks.append(self._add_chunk(view[start + offset:start + stop], locator))
        self._packs.settle()  # nothing may read the caller's buffer once this returns
        return self._add_entry(path, len(view), chunks, mode)

    def add_stream(self, path: str, stream: IO[bytes], *, size: int | None = None,
                   cuts: Iterable[int] = (), mode: int | None = None,
                   locators: Sequence[Hashable] | None = None) -> FileEntry:
        """Add a file read from ``stream`` chunk by chunk (memory stays at one chunk).

        With ``cuts``, ``size`` is required and the stream must hold exactly ``size`` bytes.
        ``locators``, one per cut, name what the segment starting at each cut holds in a way
        that stays true from one snapshot to the next (see the module docstring).
        """
        self._check_new_path(path)
        cuts = list(cuts)
        if cuts and size is None:
            raise ConfigError("add_stream with cuts needs size= (the stream's length)")
        by_start = _by_start(path, cuts, locators)
        if size is not None and size >= READ_AHEAD_MIN_BYTES:
            return self._add_entry(path, size, self._add_read_ahead(path, stream, size, cuts,
                                                                    by_start), mode)
        # Two buffers, read into in turn: the pack writer may still be sealing the previous
        # chunk (an encrypted store) while the next one is read and hashed.
        views = [memoryview(bytearray(self._max_chunk)) for _ in range(2)]
        busy: int | None = None  # the buffer of the chunk the pack writer may still be sealing
        chunks: list[ChunkRef] = []
        total = 0
        bounds = segments(size, cuts) if size is not None else None
        seg_index = 0
        segment_chunk = 0
        while True:
            want = self._max_chunk
            locator: Hashable | None = None
            if bounds is not None:
                while seg_index < len(bounds) and total >= bounds[seg_index][1]:
                    seg_index += 1
                    segment_chunk = 0
                if seg_index == len(bounds):
                    break
                start = bounds[seg_index][0]
                want = min(want, bounds[seg_index][1] - total)
                if start in by_start:
                    locator = (path, by_start[start], segment_chunk)
                segment_chunk += 1
            slot = len(chunks) % 2
            if busy == slot:
                self._packs.settle()
                busy = None
            view = views[slot]
            got = _read_exactly(stream, view[:want])
            if got == 0:
                break
            handed = self._packs.writes
            chunks.append(self._add_chunk(view[:got], locator))
            if self._packs.writes != handed:  # handing it over settled the other buffer's
                busy = slot
            total += got
            if got < want:
                break
        self._packs.settle()
        if size is not None and total != size:
            raise ConfigError(f"{path}: the stream held {total} bytes, not the {size} declared")
        return self._add_entry(path, total, chunks, mode)

    def _add_read_ahead(self, path: str, stream: IO[bytes], size: int, cuts: list[int],
                        by_start: dict[int, Hashable]) -> list[ChunkRef]:
        """:meth:`add_stream`'s chunks of a large stream of known ``size``, read a window
        ahead on a thread of its own (:mod:`cairn.store.read_ahead`, ADR 0045). The
        chunks are those the one-thread loop makes: ``max_chunk`` pieces of each segment
        between cuts, the last one shorter."""
        plan = []
        for start, end in segments(size, cuts):
            located = start in by_start
            for index, offset in enumerate(range(start, end, self._max_chunk)):
                plan.append(PlannedChunk(min(self._max_chunk, end - offset),
                                         (path, by_start[start], index) if located else None))
        chunks: list[ChunkRef] = []
        with ReadAhead(stream, plan, read=_read_exactly) as windows:
            for window in windows:
                view = window.view
                for chunk in window.chunks:
                    chunks.append(self._add_chunk(view[chunk.offset:chunk.offset + chunk.length],
                                                  chunk.locator))
                self._packs.settle()  # the pack writer may still be sealing the last one
                windows.release(window)
            total = windows.total
        if total != size:
            raise ConfigError(f"{path}: the stream held {total} bytes, not the {size} declared")
        return chunks

    def add_file(self, path: str, source: str | os.PathLike[str], *,
                 cuts: Iterable[int] = (),
                 locators: Sequence[Hashable] | None = None) -> FileEntry:
        """Add the file at ``source`` (streamed) under ``path``, keeping its permission bits."""
        with open(source, "rb") as f:
            st = os.fstat(f.fileno())
            return self.add_stream(path, f, size=st.st_size, cuts=cuts,
                                   mode=stat.S_IMODE(st.st_mode), locators=locators)

    def _check_new_path(self, path: str) -> None:
        self._check_open()
        try:
            check_relative_path(path)
        except ValueError as e:
            raise ConfigError(f"{e}; give a relative path such as 'model/weights.bin'") from None
        if path in self._files:
            raise ConfigError(f"{path!r} was already added to this snapshot")

    def _add_entry(self, path: str, size: int, chunks: list[ChunkRef],
                   mode: int | None) -> FileEntry:
        entry = FileEntry(path, size, tuple(chunks), mode)
        self._files[path] = entry
        self.stats.bytes_logical += size
        return entry

    def _add_chunk(self, data: memoryview, locator: Hashable | None = None) -> ChunkRef:
        digest = self._store.chunk_digest(data)
        self.stats.chunks_total += 1
        ref = self._reuse(digest, len(data))
        tracked = locator is not None and delta.delta_eligible(len(data))
        hashes: bytes | None = None
        if ref is not None:
            self.stats.chunks_reused += 1
            if tracked:
                self._track(locator, ref, data)
        else:
            if tracked:
                ref, hashes = self._add_delta(data, digest, locator)
            if ref is None:
                pack, offset = self._packs.add(data)
                ref = ChunkRef(digest, len(data), pack, offset)
                self.stats.bytes_written += len(data)
                if tracked:
                    self._track(locator, ref, data, hashes)
            self._attempt.known_chunks[digest] = ref
        if self._progress is not None:
            self._progress(len(data))
        return ref

    def _track(self, locator: Hashable, ref: ChunkRef, data: memoryview,
               hashes: bytes | None = None) -> None:
        """Note the full chunk the next snapshot's chunk at ``locator`` may be a delta of."""
        if self._last:
            return  # no next snapshot
        state = self._attempt.deltas
        base = ref if not ref.is_delta else state.delta_bases.get(ref.digest)
        if base is None:  # a delta from an earlier try, whose base this one never saw
            return
        if base.digest not in state.hashes:
            if ref.is_delta:
                return
            state.hashes[base.digest] = hashes or delta.page_hashes(data)
        if ref.is_delta:
            self._delta_bases[ref.digest] = base
        self._bases[locator] = base

    def _add_delta(self, data: memoryview, digest: str, locator: Hashable
                   ) -> tuple[ChunkRef | None, bytes | None]:
        """Store ``data`` as a delta of the previous snapshot's chunk at ``locator`` if that
        saves enough; else ``(None, the page hashes if computed)``."""
        state = self._attempt.deltas
        base = state.bases.get(locator)
        if base is None or base.is_delta or base.size != len(data):
            return None, None
        base_hashes = state.hashes.get(base.digest)
        if base_hashes is None:
            return None, None
        hashes = delta.page_hashes(data)
        mask = delta.changed_mask(hashes, base_hashes)
        if not delta.worth_a_delta(mask, len(data)) or not self._protect(base):
            return None, hashes
        pages = delta.gather(data, mask)
        pack, offset = self._packs.add(pages)
        self.stats.bytes_written += len(pages)
        self.stats.chunks_delta += 1
        state.delta_bases[digest] = base
        self._delta_bases[digest] = base
        self._bases[locator] = base
        return ChunkRef(digest, len(data), pack, offset, base.pack, base.offset, mask), None

    def _reuse(self, digest: str, size: int) -> ChunkRef | None:
        ref = self._attempt.known_chunks.get(digest)
        if ref is None or ref.size != size:
            return None
        return ref if self._protect(ref) else None

    def _condemned(self) -> frozenset[str]:
        """The packs GC condemned, read once, before the first reuse (cairn.store.condemned):
        none on a backend whose deletes a touch guards."""
        if self._condemned_packs is None:
            backend = self._store.backend
            self._condemned_packs = (frozenset() if backend.guarded_deletes
                                     else condemned_packs(backend))
        return self._condemned_packs

    def _protect(self, ref: ChunkRef) -> bool:
        """Touch every pack ``ref`` reads from (GC then keeps them for its grace period);
        False when one is gone, whose chunks are then forgotten."""
        for pack in ref.packs():
            if pack in self._packs.created or pack in self._fresh_packs:
                continue
            if pack in self._condemned():
                self._attempt.forget_pack(pack)
                return False
            try:
                self._store.backend.touch(pack)
            except NotFound:
                self._attempt.forget_pack(pack)
                return False
            self._fresh_packs.add(pack)
        return True

    # -- finishing -----------------------------------------------------------------------

    def commit(self, *, step: int | None = None, compat: Mapping[str, Any] | None = None,
               user: Mapping[str, Any] | None = None) -> Manifest:
        """Make every pack durable, then create the ``snap`` record.

        Durable when this returns. Raises :class:`~cairn.exceptions.Fenced` when another
        attempt took the seq, and :class:`~cairn.exceptions.SnapshotTooSlow` when the
        snapshot outlived half the GC grace (its reused chunks may no longer be protected).
        """
        def publish(manifest: Manifest) -> None:
            self._attempt.log.append(RecordKind.SNAP, {"manifest": manifest.to_json()})

        manifest = self._finish(self._attempt.log.next_seq, step, compat, user, publish)
        self._attempt.committed(manifest)
        return manifest

    def commit_part(self, *, seq: int, rank: int, step: int | None = None,
                    compat: Mapping[str, Any] | None = None,
                    user: Mapping[str, Any] | None = None) -> Manifest:
        """Commit this rank's part of distributed snapshot ``seq`` (rank 0 announces ``seq``).

        Durable when this returns; visible to readers only once rank 0's
        :meth:`~cairn.store.attempt.Attempt.commit_parts` creates the ``snap`` record.
        """
        if not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"rank must be a non-negative integer, not {rank!r}")

        def publish(manifest: Manifest) -> None:
            self._attempt.publish_part(manifest, rank=rank)

        manifest = self._finish(seq, step, compat, user, publish)
        self._attempt.remember(manifest)
        return manifest

    def _finish(self, seq: int, step: int | None, compat: Mapping[str, Any] | None,
                user: Mapping[str, Any] | None, publish: Callable[[Manifest], None]) -> Manifest:
        self._check_open()
        try:
            self._packs.flush()
            elapsed = time.monotonic() - self._started
            if elapsed > self._store.gc_grace_seconds / 2:
                raise SnapshotTooSlow(
                    f"the snapshot took {elapsed:.1f}s, more than half the store's GC grace "
                    f"({self._store.gc_grace_seconds:g}s); not committed. Raise "
                    "gc_grace_seconds in the store's cairn-store.json or snapshot less data"
                )
            manifest = Manifest(
                key=self._attempt.key.components,
                seq=seq,
                epoch=self._attempt.epoch,
                parent=self._parent.seq if self._parent is not None else None,
                created_at=format_timestamp(),
                mode=self._mode,
                files=tuple(self._files.values()),
                metadata=self._metadata(step, compat, user),
            )
            publish(manifest)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        if self._bases:
            self._attempt.deltas = self._attempt.deltas.advanced(manifest.seq, self._bases,
                                                                 self._delta_bases)
        return manifest

    def _metadata(self, step: int | None, compat: Mapping[str, Any] | None,
                  user: Mapping[str, Any] | None) -> dict[str, Any]:
        return {
            "step": step,
            "bytes_logical": self.stats.bytes_logical,
            "bytes_written": self.stats.bytes_written,
            "padding_bytes": self._packs.padding_bytes,  # zeros aligning chunks in packs
            "chunks": self.stats.chunks_total,
            "chunks_reused": self.stats.chunks_reused,
            "chunks_delta": self.stats.chunks_delta,
            "producer": {
                "cairn": __version__,
                "python": platform.python_version(),
                **writer_identity(),
            },
            "compat": dict(compat or {}),
            "user": dict(user or {}),
        }

    def abort(self) -> None:
        """Discard everything; nothing becomes visible. Safe to call more than once."""
        if not self._closed:
            self._closed = True
            self._packs.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this snapshot was already committed or aborted; start a new one")

    def __enter__(self) -> SnapshotWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def _by_start(path: str, cuts: list[int], locators: Sequence[Hashable] | None
              ) -> dict[int, Hashable]:
    """Each cut's locator, by the offset of the segment it starts."""
    if locators is None:
        return {}
    if len(locators) != len(cuts):
        raise ConfigError(f"{path}: give one locator per cut ({len(locators)} locators, "
                          f"{len(cuts)} cuts)")
    return dict(zip(cuts, locators))


def _read_exactly(stream: IO[bytes], view: memoryview) -> int:
    """Fill ``view`` from ``stream``; fewer bytes only at end of stream."""
    filled = 0
    readinto = getattr(stream, "readinto", None)
    while filled < len(view):
        if readinto is not None:
            n = readinto(view[filled:])
        else:
            piece = stream.read(len(view) - filled)
            n = len(piece)
            view[filled:filled + n] = piece
        if not n:
            break
        filled += n
    return filled
