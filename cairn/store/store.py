"""The Store, whose one job is the snapshots of every key: the slot logs, opening attempts
(:mod:`cairn.store.attempt`), restore with fallback, verification, retention and GC. The
records beside each log (outcomes, requests) are :mod:`cairn.store.records`, its settings
:mod:`cairn.store.settings`, what a URL means :mod:`cairn.store.kinds`.

Typical use::

    store = cairn.open_store("file:///data/cairn")      # or a bucket: gs://bucket/prefix
    attempt = store.open_attempt(Key.parse("dag/task/run/0"))
    parent = attempt.parent                               # the snapshot to resume from, or None
    with attempt.snapshot() as snap:
        snap.add_file("model.pt", "/tmp/model.pt")
        snap.commit(step=100)                             # durable when it returns
    attempt.finish()                                      # the step succeeded: done, then prune

Thread contract: a :class:`Store` may be shared by threads; an :class:`Attempt` and its
:class:`~cairn.store.writer.SnapshotWriter` belong to one thread at a time.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import (
    AlreadyExists,
    ConfigError,
    CorruptSnapshot,
    NoSnapshot,
    NotFound,
    RollbackRefused,
    StoreError,
)
from cairn.store.attempt import Attempt
from cairn.store.backend import SCRATCH_PREFIX, Backend
from cairn.store.hashing import digest as plain_digest
from cairn.store.keyring import (
    KEYRING_PREFIX,
    Keyring,
    Secret,
    SecretError,
    create_keyring,
    load_keyring,
    rotate_keyring,
)
from cairn.store.keys import Key
from cairn.store.manifest import (
    ChunkRef,
    Manifest,
    dumps,
)
from cairn.store.outcomes import PREVIOUS_NOTE, previous_summary
from cairn.store.reader import SnapshotReader
from cairn.store.sealed_backend import SealedBackend
from cairn.store.sealing import TAG_BYTES, Sealer
from cairn.store.records import Records
from cairn.store.slotlog import (
    AttemptLog,
    Record,
    RecordKind,
    SlotLog,
    key_paths,
    record_name,
)
from cairn.store.timestamps import format_timestamp
from cairn.store.kinds import store_kind
from cairn.store.url import open_backend
from cairn.store.verdicts import reading
from cairn.store.settings import (
    CONFIG_NAME,
    DEFAULT_GC_GRACE_SECONDS,
    SEALED_STORE_FORMAT,
    STORE_FORMAT,
    StoreSettings,
)
from cairn.store.writer import ProgressCallback

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot as the log lists it (not yet verified)."""

    key: Key
    seq: int
    epoch: int
    manifest: Manifest


@dataclass(frozen=True)
class RestoreResult:
    manifest: Manifest
    skipped: tuple[tuple[int, str], ...] = ()


@dataclass
class VerifyReport:
    """Per snapshot: ``None`` when it verified, else the reason. ``bad_chunks`` maps each
    corrupt chunk digest to its reason and the seqs that reference it."""

    key: Key
    results: dict[int, str | None] = field(default_factory=dict)
    bad_chunks: dict[str, tuple[str, list[int]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(reason is None for reason in self.results.values())


def describe_shared(digest: str, seqs: list[int]) -> str:
    seqs = sorted(seqs)
    span = f"seq {seqs[0]}" if len(seqs) == 1 else f"seq {seqs[0]}..{seqs[-1]}"
    return f"chunk {digest}, referenced by {span}"


class Store:
    """A cairn store over one backend. Opened by :func:`cairn.open_store` (the secret and the
    first contact's bound the environment configures), or :meth:`open` (explicit ones)."""

    @classmethod
    def open(cls, url: str, *, settings: StoreSettings | None = None, create: bool = True,
             secret: Secret | None = None, connect_timeout: float | None = None) -> Store:
        """Open the store at ``url`` (any form :mod:`cairn.store.kinds` accepts), reading no
        environment: with ``secret``, a new store is created encrypted and an encrypted one is
        opened with its keyring; an unencrypted store then refuses to open (no silent
        downgrade). Without, an encrypted store raises
        :class:`~cairn.store.keyring.SecretError`. ``connect_timeout``: the first contact's
        bound (:func:`~cairn.store.url.open_backend`). A store that cannot be reached raises
        :class:`~cairn.exceptions.StoreUnreachable`."""
        backend = open_backend(url, create=create, connect_timeout=connect_timeout)
        try:
            return cls(backend, settings=settings, create=create, secret=secret)
        except BaseException:
            backend.close()
            raise

    def __init__(self, backend: Backend, *, settings: StoreSettings | None = None,
                 create: bool = True, secret: Secret | None = None) -> None:
        self.raw_backend = backend
        self.backend: Backend = backend  # sealing, once an encrypted store's keyring is open
        self.settings = (settings or StoreSettings()).resolved(
            remote=store_kind(backend.url).remote)  # a bucket keeps more transfers in flight
        self.secret = secret
        self.keyring: Keyring | None = None
        self.sealer: Sealer | None = None
        self.config = self._load_or_create_config(create)
        self.gc_grace_seconds = float(self.config.get("gc_grace_seconds", DEFAULT_GC_GRACE_SECONDS))
        if self.encrypted:
            self._open_keyring()
        self.pool = ThreadPoolExecutor(max_workers=self.settings.io_threads,
                                       thread_name_prefix="cairn-io")

    # -- encryption (ADR 0025) -----------------------------------------------------------------

    @property
    def encrypted(self) -> bool:
        return self.config.get("format") == SEALED_STORE_FORMAT

    @property
    def store_id(self) -> str | None:
        return self.config.get("store_id")

    def _open_keyring(self) -> None:
        store_id = str(self.config["store_id"])
        if self.secret is None:
            raise SecretError(f"the store {self.raw_backend.url} is encrypted and no secret is "
                              "configured: give the secret it was created with")
        if self.keyring is None or self.keyring.store_id != store_id:  # not the one just made
            self.keyring = load_keyring(self.raw_backend, store_id=store_id, secret=self.secret)
        self._use_keyring(self.keyring)

    def _use_keyring(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self.sealer = keyring.sealer()
        self.backend = SealedBackend(self.raw_backend, self.sealer,
                                     raw_names=frozenset({CONFIG_NAME}))

    def rotate_keys(self, *, new_secret: Secret | None = None,
                    new_data_key: bool = True) -> Keyring:
        """Add a keyring record: a new active data key (old ones stay, for reading), sealed
        by ``new_secret`` when given (which then opens every key; the old secret opens the
        records before it only). Durable when it returns."""
        if self.keyring is None or self.secret is None:
            raise ConfigError(f"the store {self.url} is not encrypted; there are no keys to "
                              "rotate (an encrypted store is created with a secret)")
        keyring = rotate_keyring(self.raw_backend, self.keyring,
                                 secret=new_secret or self.secret, now=format_timestamp(),
                                 new_data_key=new_data_key)
        if new_secret is not None:
            self.secret = new_secret
        self._use_keyring(keyring)
        return keyring

    def chunk_digest(self, data: bytes | bytearray | memoryview) -> str:
        """A chunk's name: BLAKE3, keyed by the store's naming key when it is encrypted."""
        if self.sealer is not None:
            return self.sealer.digest(data)
        return plain_digest(data)

    @property
    def url(self) -> str:
        return self.backend.url

    def _load_or_create_config(self, create: bool) -> dict[str, Any]:
        try:
            return self._parse_config(self.backend.read(CONFIG_NAME))
        except NotFound:
            pass
        if not create:
            raise NotFound(f"no cairn store at {self.backend.url} (no {CONFIG_NAME}); "
                           "check the URL, or write a snapshot there first")
        for info in self.backend.list(""):
            if info.name.startswith(KEYRING_PREFIX):  # another process is creating it
                continue
            if info.name.startswith(SCRATCH_PREFIX):  # a backend's probe, gone in a moment
                continue
            if info.name == CONFIG_NAME:  # another process created the store meanwhile
                return self._parse_config(self.backend.read(CONFIG_NAME))
            raise ConfigError(
                f"{self.backend.url} is not empty and is not a cairn store; "
                "give a new or empty directory or bucket prefix"
            )
        config: dict[str, Any] = {"format": STORE_FORMAT,
                                  "gc_grace_seconds": DEFAULT_GC_GRACE_SECONDS,
                                  "created_at": format_timestamp()}
        if self.secret is not None:
            # Encrypted from the first object: the keyring exists before the config that
            # names the store encrypted, so no reader ever sees one without the other.
            config["format"] = SEALED_STORE_FORMAT
            config["store_id"] = uuid.uuid4().hex
            try:
                self.keyring = create_keyring(self.backend, store_id=config["store_id"],
                                              secret=self.secret, now=config["created_at"])
            except AlreadyExists:  # another process is creating this store: use its config
                return self._await_config()
        try:
            self.backend.create(CONFIG_NAME, dumps(config))
        except AlreadyExists:
            return self._parse_config(self.backend.read(CONFIG_NAME))
        return config

    def _await_config(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._parse_config(self.backend.read(CONFIG_NAME))
            except NotFound:
                if time.monotonic() > deadline:
                    raise StoreError(f"{self.backend.url} has a keyring but no {CONFIG_NAME}: "
                                     "a store creation was interrupted; give an empty "
                                     "location") from None
                time.sleep(0.05)

    def _parse_config(self, data: bytes) -> dict[str, Any]:
        try:
            config = json.loads(data)
            fmt = config.get("format")
        except (ValueError, AttributeError):
            raise StoreError(f"{self.backend.url}/{CONFIG_NAME} is corrupt") from None
        if fmt not in (STORE_FORMAT, SEALED_STORE_FORMAT):
            raise ConfigError(f"store {self.backend.url} has format {fmt!r}; this cairn reads "
                              f"{STORE_FORMAT} and {SEALED_STORE_FORMAT}: upgrade cairn")
        if fmt == STORE_FORMAT and self.secret is not None:
            # Never a silent downgrade: whoever can write the bucket could otherwise replace
            # an encrypted store's config and have this process read planted plaintext.
            raise SecretError(f"the store {self.backend.url} is not encrypted, but a secret is "
                              "configured: unset the secret to use this store unencrypted, or "
                              "give a new store location to create an encrypted one")
        if fmt == SEALED_STORE_FORMAT and not isinstance(config.get("store_id"), str):
            raise StoreError(f"{self.backend.url}/{CONFIG_NAME} is corrupt (no store id)")
        return config

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys and history ------------------------------------------------------------------

    def log(self, key: Key) -> SlotLog:
        return SlotLog(self.backend, key)

    def keys(self) -> list[Key]:
        """Every key with a log in this store (components as written in their records)."""
        keys = []
        for path in key_paths(self.backend):
            key = self._key_of_path(path)
            if key is not None:
                keys.append(key)
        return keys

    def _key_of_path(self, path: str) -> Key | None:
        # Components may be hashed in the path; the records hold the originals.
        path_log = SlotLog(self.backend, path)
        for seq in reversed(path_log.seqs()):
            try:
                return Key(path_log.read(seq).key)
            except (CorruptSnapshot, NotFound):
                continue
        return None

    def snapshots(self, key: Key) -> list[SnapshotInfo]:
        """Committed snapshots after the last ``done``, newest first; unreadable ones logged."""
        out: list[SnapshotInfo] = []
        for record in self.log(key).newest_first():
            if record.kind is RecordKind.DONE:
                break
            if record.kind is RecordKind.SNAP and record.manifest is not None:
                out.append(SnapshotInfo(key, record.seq, record.epoch, record.manifest))
        return out

    def history(self, key: Key) -> list[Record]:
        return self.log(key).records()

    @property
    def records(self) -> Records:
        """The records beside each key's slot log: outcomes, suspend and resume requests, the
        tries they describe (:mod:`cairn.store.records`)."""
        return Records(self.backend)

    def manifest(self, key: Key, seq: int | None = None) -> Manifest:
        """The manifest of snapshot ``seq`` (default: the newest committed one)."""
        if seq is None:
            snaps = self.snapshots(key)
            if not snaps:
                raise NoSnapshot(f"key {key} has no committed snapshot in {self.url}")
            return snaps[0].manifest
        record = self.log(key).read(seq)
        if record.manifest is None:
            raise NotFound(f"key {key}: seq {seq} is an {record.kind.value!r} record, not a snapshot")
        return record.manifest

    # -- writing -----------------------------------------------------------------------------

    def join_attempt(self, key: Key, *, epoch: int) -> Attempt:
        """Another rank's view of the attempt that rank 0 opened at ``epoch``.

        It creates no record; it writes parts (``commit_part``) and dedups against the same
        parent. Raises NotFound when there is no ``open`` record at ``epoch``.
        """
        record = self.log(key).read(epoch)
        if record.kind is not RecordKind.OPEN:
            raise NotFound(f"key {key}: seq {epoch} is not an attempt's open record")
        return Attempt(self, key, AttemptLog(self.log(key), epoch=epoch),
                       self.latest_good(key, deep=False))

    def resume_attempt(self, key: Key, *, epoch: int, last_seq: int,
                       parent_seq: int | None) -> Attempt:
        """Take over an attempt another process opened (a writer process, a restarted one).

        Records of the same epoch past ``last_seq`` are adopted; a newer attempt's record
        leaves the returned attempt fenced. The parent (for dedup) is ``parent_seq``'s snapshot
        when it is still there.
        """
        attempt_log = AttemptLog(self.log(key), epoch=epoch, last_seq=last_seq)
        attempt_log.catch_up()
        parent = None
        candidates = [attempt_log.last_seq] + ([parent_seq] if parent_seq is not None else [])
        for seq in candidates:
            try:
                parent = self.manifest(key, seq).decoded()
                break
            except (NotFound, CorruptSnapshot):
                continue
        return Attempt(self, key, attempt_log, parent)

    def open_attempt(self, key: Key, *, note: dict[str, Any] | None = None,
                     exclude: Collection[int] = (),
                     not_older_than: int | None = None) -> Attempt:
        """Start an attempt: its ``open`` record fences every older attempt of ``key``.

        Its parent is the newest snapshot whose manifest reads and whose packs all exist and
        whose seq is not in ``exclude``; pass it to a restore, and later snapshots dedup
        against it. The ``open`` record notes it as ``resumed_from``, and notes what the
        previous try did (``previous``, :func:`~cairn.store.outcomes.previous_summary`), so
        that a try killed before it recorded its outcome keeps its history once retention
        or ``done`` removes its snapshots (docs/adr/0031).

        ``not_older_than``: the newest seq an earlier try of ``key`` committed, as recorded
        outside the store; a parent older than that raises
        :class:`~cairn.exceptions.RollbackRefused` before anything is written, unless a
        ``done`` record (the key finished, or was removed) came after it or ``exclude`` passes
        over a seq at least that new (a resume policy chose the older snapshot).
        """
        parent = self.latest_good(key, deep=False, exclude=exclude)
        if not_older_than is not None:
            self._refuse_rollback(key, parent, not_older_than, exclude)
        note = dict(note or {})
        note.setdefault("resumed_from", parent.seq if parent else None)
        note.setdefault("resumed_step", parent.step if parent else None)
        try:
            previous = previous_summary(self.log(key).newest_first())
        except StoreError as e:  # history is advice: it never stops a try from starting
            log.warning("key %s: could not summarize the previous try: %s", key, e)
            previous = None
        if previous is not None:
            note.setdefault(PREVIOUS_NOTE, previous)
        attempt_log = self.log(key).open_attempt(note=note)
        return Attempt(self, key, attempt_log, parent)

    def _refuse_rollback(self, key: Key, parent: Manifest | None, recorded: int,
                         exclude: Collection[int]) -> None:
        found = parent.seq if parent is not None else None
        if (found is not None and found >= recorded) or any(s >= recorded for s in exclude):
            return
        for record in self.log(key).newest_first():
            if record.seq <= recorded:
                break
            if record.kind is RecordKind.DONE:  # finished or removed since: a fresh start
                return
        newest = "no snapshot" if found is None else f"snapshot seq {found}"
        raise RollbackRefused(
            f"key {key}: a try committed snapshot seq {recorded}, but the newest this store "
            f"offers is {newest}: the newer ones were deleted from {self.url} or fail their "
            "checks (see the warnings above); refusing to roll the work back",
            recorded=recorded, found=found)

    # -- reading -----------------------------------------------------------------------------

    def reader(self, manifest: Manifest) -> SnapshotReader:
        return SnapshotReader(self.backend, manifest, pool=self.pool,
                              prefetch=self.settings.read_prefetch, sealer=self.sealer)

    def check_present(self, manifest: Manifest) -> None:
        """Cheap structural check: every pack exists and is long enough for its chunks.

        The packs are looked up on the store's pool, all at once: one after the other they
        cost a round trip each on a bucket (a 1 GiB image has ~35 packs). Not to be called
        from the pool itself."""
        tail = TAG_BYTES if self.sealer is not None else 0
        ends = manifest.pack_ends()

        def size_of(pack: str) -> int | None:
            try:
                return self.backend.stat(pack).size
            except NotFound:
                return None

        for (pack, last), size in zip(ends.items(), self.pool.map(size_of, ends)):
            end = last + tail
            if size is None:
                raise CorruptSnapshot(f"snapshot seq {manifest.seq}: pack {pack} is missing",
                                      seq=manifest.seq)
            if size < end:
                raise CorruptSnapshot(f"snapshot seq {manifest.seq}: pack {pack} is truncated "
                                      f"({size} < {end} bytes)", seq=manifest.seq)

    def latest_good(self, key: Key, *, deep: bool = False,
                    exclude: Collection[int] = ()) -> Manifest | None:
        """The newest snapshot that checks out, skipping bad ones with a logged reason.

        ``deep=False`` checks the manifest and that every pack is present; ``deep=True``
        reads and verifies every chunk. Snapshots whose seq is in ``exclude`` (a resume
        policy's verdict) are passed over. ``None`` when there is none (or the key is done).
        Only a store verdict skips one: a failure on this side raises RestoreFailed.
        """
        for info in self.snapshots(key):
            if info.seq in exclude:
                continue
            try:
                with reading(info.seq):  # only a verdict skips it (cairn.store.verdicts)
                    self.check_present(info.manifest)
                    if deep:
                        self.reader(info.manifest).verify()
                return info.manifest
            except CorruptSnapshot as e:
                log.warning("key %s: skipping snapshot seq %d: %s", key, info.seq, e)
        return None

    def restore(self, key: Key, dest: str | os.PathLike[str], *, seq: int | None = None,
                progress: ProgressCallback | None = None) -> RestoreResult:
        """Restore the newest snapshot that verifies (or exactly ``seq``) into ``dest``.

        Verification happens inside the restore pass; a snapshot that fails is removed from
        ``dest`` and the previous one is tried. Raises :class:`NoSnapshot` when none verifies,
        naming a corrupt chunk that every candidate shares, and
        :class:`~cairn.exceptions.RestoreFailed` (nothing skipped) when reading failed on this
        side (:mod:`cairn.store.verdicts`).
        """
        candidates = [self.manifest(key, seq)] if seq is not None else \
            [info.manifest for info in self.snapshots(key)]
        if not candidates:
            raise NoSnapshot(f"key {key} has no committed snapshot in {self.url}")
        skipped: list[tuple[int, str]] = []
        bad: dict[str, list[int]] = {}
        for manifest in candidates:
            try:
                with reading(manifest.seq):
                    self.reader(manifest).restore_to(dest, progress=progress)
                for skipped_seq, reason in skipped:
                    log.warning("key %s: skipped snapshot seq %d: %s", key, skipped_seq, reason)
                return RestoreResult(manifest, tuple(skipped))
            except CorruptSnapshot as e:
                skipped.append((manifest.seq, str(e)))
                if e.digest:
                    bad.setdefault(e.digest, []).append(manifest.seq)
        raise NoSnapshot(_no_good_message(key, candidates, skipped, bad))

    def verify(self, key: Key, *, progress: ProgressCallback | None = None,
               checked: dict[tuple[str, int, str], str | None] | None = None) -> VerifyReport:
        """Check every retained snapshot of ``key`` fully; each distinct chunk is read once.

        ``checked`` (pack, offset, digest -> reason or None) carries what earlier calls read,
        so that verifying many keys reads a chunk they share once; it is updated in place."""
        report = VerifyReport(key)
        checked = {} if checked is None else checked
        for info in self.snapshots(key):
            try:
                chunks = list(info.manifest.chunk_refs())
            except CorruptSnapshot as e:  # a chunk table that does not decode (ADR 0044)
                report.results[info.seq] = str(e)
                continue
            reason = None
            for chunk in chunks:
                ident = (chunk.pack, chunk.offset, chunk.digest)
                if ident not in checked:
                    checked[ident] = self._verify_chunk(chunk, progress)
                if checked[ident] is not None:
                    reason = reason or checked[ident]
                    entry = report.bad_chunks.setdefault(chunk.digest, (checked[ident], []))
                    if info.seq not in entry[1]:
                        entry[1].append(info.seq)
            report.results[info.seq] = reason
        return report

    def _verify_chunk(self, chunk: ChunkRef, progress: ProgressCallback | None) -> str | None:
        from cairn.store.delta import apply as apply_delta

        pieces = []
        tail = TAG_BYTES if self.sealer is not None else 0
        for pack, offset, length in chunk.extents():
            try:
                data = self.backend.read_range(pack, offset, length + tail)
            except NotFound:
                return f"pack {pack} is missing"
            if len(data) != length + tail:
                return f"truncated in {pack} ({len(data) - tail} of {length} bytes)"
            if self.sealer is not None:
                try:
                    data = self.sealer.open_extent(pack, offset, data)
                except CorruptSnapshot as e:
                    return str(e)
            pieces.append(data)
        if progress is not None:
            progress(chunk.size)
        if chunk.is_delta:
            assembled = bytearray(pieces[0])
            apply_delta(memoryview(assembled), memoryview(pieces[1]), chunk.delta_mask)
            data = bytes(assembled)
        if self.chunk_digest(data) != chunk.digest:
            return f"digest mismatch in {chunk.pack}"
        return None

    # -- retention and removal ---------------------------------------------------------------

    def prune(self, key: Key, *, keep: int | None = None) -> list[int]:
        """Delete all but the newest ``keep`` snapshot records (default: settings.keep_last).

        ``open`` and ``done`` records are never deleted. Packs are freed later by GC.
        Returns the seqs deleted.
        """
        keep = self.settings.keep_last if keep is None else keep
        if keep < 1:
            raise ConfigError("keep must be at least 1")
        deleted = []
        snaps_seen = 0
        done_seen = False
        for record in self.log(key).newest_first():
            if record.kind is RecordKind.DONE:
                done_seen = True
            if record.kind is not RecordKind.SNAP:
                continue
            snaps_seen += 1
            if done_seen or snaps_seen > keep:
                self._delete_record(key, record.seq)
                deleted.append(record.seq)
        return deleted

    def _delete_record(self, key: Key, seq: int) -> None:
        try:
            self.backend.delete(record_name(key.path, seq))
        except NotFound:
            pass

    def remove(self, key: Key) -> int:
        """Forget ``key``: a ``done`` record fences any live writer, then every snapshot goes.

        The final ``done`` stays as a tombstone so that a zombie writer cannot revive the key.
        Returns the number of snapshots removed.
        """
        attempt_log = self.log(key).open_attempt(note={"purpose": "remove"})
        attempt_log.append(RecordKind.DONE, {"reason": "removed"})
        return len(self.drop_snapshots(key))

    def drop_snapshots(self, key: Key) -> list[int]:
        """Delete every ``snap`` record of ``key`` (after a ``done``); their seqs."""
        deleted = []
        for record in self.log(key).records():
            if record.kind is RecordKind.SNAP:
                self._delete_record(key, record.seq)
                deleted.append(record.seq)
        return deleted

    def gc(self, *, grace_seconds: float | None = None, dry_run: bool = False):  # noqa: ANN201
        """Delete packs no manifest references, untouched for the grace period. See cairn.store.gc."""
        from cairn.store.gc import collect_garbage

        return collect_garbage(self, grace_seconds=grace_seconds, dry_run=dry_run)


def _no_good_message(key: Key, candidates: list[Manifest], skipped: list[tuple[int, str]],
                     bad: dict[str, list[int]]) -> str:
    seqs = [m.seq for m in candidates]
    lines = [f"key {key}: no snapshot verifies (tried seq {', '.join(map(str, seqs))})"]
    for digest, hit in bad.items():
        if sorted(hit) == sorted(seqs) and len(seqs) > 1:
            lines.append(f"  corrupt {describe_shared(digest, hit)} (every retained snapshot)")
    lines += [f"  seq {s}: {reason}" for s, reason in skipped]
    lines.append("  run `cairn verify` for a full report; the step will start fresh")
    return "\n".join(lines)
