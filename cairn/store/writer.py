"""SnapshotWriter: stream files into chunks and packs, then commit one ``snap`` record.

Nothing a writer does is visible to readers until :meth:`SnapshotWriter.commit` creates the
``snap`` record, which happens only after every pack it references is durable. A crash at any
earlier point leaves at most unreferenced packs, which garbage collection removes.

Dedup is only against the parent snapshot's chunks and chunks this attempt wrote itself. A
reused chunk's pack is *touched* before the reference is recorded: garbage collection never
deletes a pack touched within its grace period, and its version-guarded delete loses to a
touch that races it. A touch that finds the pack gone means the chunk is written again.
"""

from __future__ import annotations

import logging
import os
import platform
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Callable

from cairn.exceptions import ConfigError, NotFound, SnapshotTooSlow
from cairn.store.chunking import chunk_spans, segments
from cairn.store.hashing import digest as compute_digest
from cairn.store.manifest import (
    ChunkRef,
    FileEntry,
    Manifest,
    SnapshotMode,
    check_relative_path,
)
from cairn.store.packs import PackWriter
from cairn.store.slotlog import RecordKind, utc_now, writer_identity
from cairn.version import __version__

if TYPE_CHECKING:
    from cairn.store.store import Attempt

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int], None]


@dataclass
class WriteStats:
    bytes_logical: int = 0
    bytes_written: int = 0
    chunks_total: int = 0
    chunks_reused: int = 0


class SnapshotWriter:
    """Builds one snapshot of an attempt. One thread uses it; use as a context manager.

    Leaving the ``with`` block without :meth:`commit` aborts (nothing is committed).
    """

    def __init__(self, attempt: Attempt, *, mode: SnapshotMode, parent: Manifest | None,
                 progress: ProgressCallback | None = None) -> None:
        self._attempt = attempt
        self._store = attempt.store
        settings = self._store.settings
        self._max_chunk = settings.max_chunk_bytes
        self._mode = mode
        self._parent = parent
        self._progress = progress
        self._files: dict[str, FileEntry] = {}
        self._fresh_packs: set[str] = set()
        self._packs = PackWriter(
            self._store.backend,
            pack_bytes=settings.pack_bytes,
            pool=self._store.pool,
            max_inflight=settings.max_inflight_packs,
        )
        self._started = time.monotonic()
        self._closed = False
        self.stats = WriteStats()

    # -- adding data ---------------------------------------------------------------------

    def add_bytes(self, path: str, data: bytes | bytearray | memoryview, *,
                  cuts: Iterable[int] = (), mode: int | None = None) -> FileEntry:
        """Add a file from a buffer; ``cuts`` are offsets where a chunk must begin."""
        self._check_new_path(path)
        view = memoryview(data).cast("B")
        chunks = [self._add_chunk(view[start:end])
                  for start, end in chunk_spans(len(view), cuts=cuts, max_chunk=self._max_chunk)]
        return self._add_entry(path, len(view), chunks, mode)

    def add_stream(self, path: str, stream: IO[bytes], *, size: int | None = None,
                   cuts: Iterable[int] = (), mode: int | None = None) -> FileEntry:
        """Add a file read from ``stream`` chunk by chunk (memory stays at one chunk).

        With ``cuts``, ``size`` is required and the stream must hold exactly ``size`` bytes.
        """
        self._check_new_path(path)
        cuts = list(cuts)
        if cuts and size is None:
            raise ConfigError("add_stream with cuts needs size= (the stream's length)")
        buffer = bytearray(self._max_chunk)
        view = memoryview(buffer)
        chunks: list[ChunkRef] = []
        total = 0
        bounds = segments(size, cuts) if size is not None else None
        seg_index = 0
        while True:
            want = self._max_chunk
            if bounds is not None:
                while seg_index < len(bounds) and total >= bounds[seg_index][1]:
                    seg_index += 1
                if seg_index == len(bounds):
                    break
                want = min(want, bounds[seg_index][1] - total)
            got = _read_exactly(stream, view[:want])
            if got == 0:
                break
            chunks.append(self._add_chunk(view[:got]))
            total += got
            if got < want:
                break
        if size is not None and total != size:
            raise ConfigError(f"{path}: the stream held {total} bytes, not the {size} declared")
        return self._add_entry(path, total, chunks, mode)

    def add_file(self, path: str, source: str | os.PathLike[str], *,
                 cuts: Iterable[int] = ()) -> FileEntry:
        """Add the file at ``source`` (streamed) under ``path``, keeping its permission bits."""
        with open(source, "rb") as f:
            st = os.fstat(f.fileno())
            return self.add_stream(path, f, size=st.st_size, cuts=cuts,
                                   mode=stat.S_IMODE(st.st_mode))

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

    def _add_chunk(self, data: memoryview) -> ChunkRef:
        digest = compute_digest(data)
        self.stats.chunks_total += 1
        ref = self._reuse(digest, len(data))
        if ref is None:
            pack, offset = self._packs.add(data)
            ref = ChunkRef(digest, len(data), pack, offset)
            self._attempt.known_chunks[digest] = ref
            self.stats.bytes_written += len(data)
        else:
            self.stats.chunks_reused += 1
        if self._progress is not None:
            self._progress(len(data))
        return ref

    def _reuse(self, digest: str, size: int) -> ChunkRef | None:
        ref = self._attempt.known_chunks.get(digest)
        if ref is None or ref.size != size:
            return None
        if ref.pack in self._packs.created or ref.pack in self._fresh_packs:
            return ref
        try:
            self._store.backend.touch(ref.pack)
        except NotFound:
            self._attempt.forget_pack(ref.pack)
            return None
        self._fresh_packs.add(ref.pack)
        return ref

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
        :meth:`~cairn.store.store.Attempt.commit_parts` creates the ``snap`` record.
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
                    f"the snapshot took {elapsed:.0f}s, more than half the store's GC grace "
                    f"({self._store.gc_grace_seconds:.0f}s); not committed. Raise "
                    "gc_grace_seconds in the store's cairn-store.json or snapshot less data"
                )
            manifest = Manifest(
                key=self._attempt.key.components,
                seq=seq,
                epoch=self._attempt.epoch,
                parent=self._parent.seq if self._parent is not None else None,
                created_at=utc_now(),
                mode=self._mode,
                files=tuple(self._files.values()),
                metadata=self._metadata(step, compat, user),
            )
            publish(manifest)
        except BaseException:
            self.abort()
            raise
        self._closed = True
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
