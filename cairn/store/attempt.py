"""An attempt at a key's work: the one writer of its snapshots until a newer attempt fences it.

Opened by :meth:`cairn.store.Store.open_attempt` (or joined, or resumed); its snapshots are
built by :class:`~cairn.store.writer.SnapshotWriter`. Thread contract: an attempt and its
writer belong to one thread at a time.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Protocol

from cairn.exceptions import (
    AlreadyExists,
    ConfigError,
    CorruptSnapshot,
    Fenced,
    PartsMissing,
    SnapshotTooSlow,
    StoreError,
)
from cairn.store.delta import DeltaState
from cairn.store.keys import Key
from cairn.store.manifest import (
    ChunkRef,
    FileEntry,
    Manifest,
    SnapshotMode,
    dumps,
    manifest_from_json,
)
from cairn.store.slotlog import (
    PART_SCHEMA,
    AttemptLog,
    RecordKind,
    part_name,
    parts_prefix,
)
from cairn.store.timestamps import format_timestamp
from cairn.store.writer import ProgressCallback, SnapshotWriter, WriterStore

log = logging.getLogger(__name__)


class AttemptStore(WriterStore, Protocol):
    """What an attempt uses of its store (:class:`cairn.store.Store` is one)."""

    def prune(self, key: Key, *, keep: int | None = None) -> list[int]: ...

    def drop_snapshots(self, key: Key) -> list[int]: ...


class Attempt:
    """One attempt at a key's work: fenced for good once another attempt moves the log on."""

    def __init__(self, store: AttemptStore, key: Key, attempt_log: AttemptLog,
                 parent: Manifest | None) -> None:
        self.store = store
        self.key = key
        self.log = attempt_log
        self.parent = parent
        self.resumed_from = parent
        # Dedup index: the parent's chunks and every chunk this attempt wrote itself.
        self.known_chunks: dict[str, ChunkRef] = {}
        # What page deltas are taken against (cairn.store.delta), in memory for this try.
        self.deltas = DeltaState()
        if parent is not None:
            self._index(parent)

    @property
    def epoch(self) -> int:
        return self.log.epoch

    @property
    def fenced(self) -> bool:
        return self.log.fenced

    def _index(self, manifest: Manifest) -> None:
        for chunk in manifest.chunk_refs():
            self.known_chunks.setdefault(chunk.digest, chunk)

    def carry_deltas(self, state: DeltaState | None) -> None:
        """Take over the page-delta state another attempt object of this try left (the
        uploader commits each spooled dump through a new one); ignored unless it was left on
        top of this attempt's parent."""
        if state is not None and self.parent is not None and state.seq == self.parent.seq:
            self.deltas = state

    def forget_pack(self, pack: str) -> None:
        for digest in [d for d, ref in self.known_chunks.items() if pack in ref.packs()]:
            del self.known_chunks[digest]

    def snapshot(self, *, mode: SnapshotMode = SnapshotMode.FILES,
                 progress: ProgressCallback | None = None, last: bool = False
                 ) -> SnapshotWriter:
        """Begin the next snapshot; its parent is the last one committed or restored.
        ``last``: no snapshot of this attempt follows it (:class:`SnapshotWriter`)."""
        return SnapshotWriter(self, mode=mode, parent=self.parent, progress=progress,
                              last=last)

    def resume_from(self, manifest: Manifest) -> None:
        """Make ``manifest`` (the snapshot actually restored) the parent of the next snapshot,
        and the only source of dedup besides this attempt's own uploads."""
        self.parent = manifest
        self.known_chunks = {}
        self.deltas = DeltaState()
        self._index(manifest)

    def remember(self, manifest: Manifest) -> None:
        """Index a manifest this attempt committed (a snapshot or a part) for dedup."""
        self._index(manifest)

    def committed(self, manifest: Manifest) -> None:
        """Called by the writer once its ``snap`` record exists: index it and prune."""
        self.parent = manifest
        self._index(manifest)
        try:
            self.store.prune(self.key)
        except StoreError as e:  # the snapshot is committed; retention catches up next time
            log.warning("key %s: retention failed after seq %d: %s", self.key, manifest.seq, e)

    # -- distributed snapshots: each rank commits a part, rank 0 commits the snapshot -----------

    def publish_part(self, manifest: Manifest, *, rank: int) -> None:
        """Create this rank's part record, create-only (a conflict means fenced)."""
        name = part_name(self.key.path, manifest.seq, rank)
        doc = {"schema": PART_SCHEMA, "rank": rank, "epoch": self.epoch,
               "manifest": manifest.to_json()}
        try:
            self.store.backend.create(name, dumps(doc))
        except AlreadyExists:
            raise Fenced(f"key {self.key}: part {rank} of seq {manifest.seq} already exists; "
                         "another attempt has moved on") from None

    def commit_parts(self, seq: int, *, world_size: int, step: int | None = None) -> Manifest:
        """Rank 0: once every rank's part of ``seq`` exists, create the one ``snap`` record.

        Each rank's files appear under ``rank-<r>/``. Raises :class:`PartsMissing` naming the
        missing ranks when not all parts are there yet (wait at a barrier and call again), and
        :class:`Fenced` when another attempt took ``seq``.
        """
        if seq != self.log.next_seq:
            raise ConfigError(f"distributed snapshot seq must be {self.log.next_seq} (rank 0's "
                              f"next seq), not {seq}; broadcast attempt.log.next_seq to the ranks")
        if world_size < 1:
            raise ConfigError("world_size must be at least 1")
        parts: dict[int, Manifest] = {}
        for info in self.store.backend.list(parts_prefix(self.key.path, seq)):
            if time.time() - info.updated > self.store.gc_grace_seconds / 2:
                raise SnapshotTooSlow(f"key {self.key}: part {info.name} is older than half the "
                                      "GC grace; its packs may be collected. Take a new snapshot")
            part = self._read_part(info.name)
            if part is not None:
                parts[part[0]] = part[1]
        missing = [r for r in range(world_size) if r not in parts]
        if missing:
            raise PartsMissing(f"key {self.key}: seq {seq} lacks parts from ranks {missing}",
                               missing=missing)
        files = tuple(
            FileEntry(f"rank-{rank}/{entry.path}", entry.size, entry.chunks, entry.mode)
            for rank in range(world_size) for entry in parts[rank].files
        )
        written = sum(parts[r].bytes_written for r in range(world_size))
        manifest = Manifest(
            key=self.key.components, seq=seq, epoch=self.epoch,
            parent=self.parent.seq if self.parent else None, created_at=format_timestamp(),
            mode=parts[0].mode, files=files,
            metadata={"step": step, "bytes_logical": sum(f.size for f in files),
                      "bytes_written": written, "world_size": world_size,
                      "ranks": [parts[r].metadata for r in range(world_size)]},
        )
        self.log.append(RecordKind.SNAP, {"manifest": manifest.to_json()})
        for rank in range(world_size):
            try:
                self.store.backend.delete(part_name(self.key.path, seq, rank))
            except StoreError:
                pass  # GC removes stale parts
        self.committed(manifest)
        return manifest

    def _read_part(self, name: str) -> tuple[int, Manifest] | None:
        try:
            data = self.store.backend.read(name)  # a failure of the read itself is no verdict
        except CorruptSnapshot as e:  # a sealed part that fails authentication
            log.warning("key %s: ignoring unreadable part %s: %s", self.key, name, e)
            return None
        try:
            doc = json.loads(data)
            rank, epoch = int(doc["rank"]), int(doc["epoch"])
            if doc.get("schema") != PART_SCHEMA or epoch != self.epoch:
                log.warning("key %s: ignoring part %s of another attempt", self.key, name)
                return None
            return rank, manifest_from_json(doc["manifest"])
        except (ValueError, KeyError, TypeError, CorruptSnapshot) as e:
            log.warning("key %s: ignoring unreadable part %s: %s", self.key, name, e)
            return None

    def finish(self) -> None:
        """The step succeeded: create ``done`` (fencing everyone), then delete the snapshots."""
        self.log.append(RecordKind.DONE, {"reason": "succeeded"})
        self.store.drop_snapshots(self.key)
