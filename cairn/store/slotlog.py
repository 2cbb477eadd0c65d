"""The slot log: a key's history as create-only records, one per sequence number.

Records live at ``keys/<key path>/@log/<seq:020d>.json`` (``@`` never appears in an encoded
key component, so one key's log can never be mistaken for another key's). The record's kind
(``open``, ``snap``, ``done``) is inside it, not in its name: the name must be the same for
every kind at a given seq, or two attempts could both "create" seq N under different names and
fencing would be void (docs/adr/0002-slot-log-names.md).

Rules:

* ``open``: an attempt starts by creating ``open`` at the first free seq; that seq is its
  **epoch**. Only opening retries at a higher seq after a conflict.
* Afterwards the attempt only ever creates its own last seq + 1. A conflict means another
  attempt has moved on: the attempt is **fenced** for good (:class:`~cairn.exceptions.Fenced`).
* ``snap`` records carry a manifest; ``done`` ends the key's work (everything before it is
  history) and fences every older attempt.
* Distributed snapshots: each rank creates ``keys/<key>/@parts/<seq>/<rank>.json``; rank 0
  lists them and creates the ``snap`` at that seq holding every rank's files.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import AlreadyExists, CorruptSnapshot, Fenced, NotFound, StoreError
from cairn.store.backend import Backend
from cairn.store.hashing import digest
from cairn.store.keys import Key
from cairn.store.manifest import Manifest, dumps, manifest_from_json
from cairn.store.timestamps import format_timestamp

log = logging.getLogger(__name__)

RECORD_SCHEMA = "cairn.record/1"
PART_SCHEMA = "cairn.part/1"
KEYS_PREFIX = "keys/"
LOG_DIR = "@log"
PARTS_DIR = "@parts"
_OPEN_RETRIES = 64


class RecordKind(str, enum.Enum):
    OPEN = "open"
    SNAP = "snap"
    DONE = "done"


def log_prefix(key_path: str) -> str:
    return f"{KEYS_PREFIX}{key_path}/{LOG_DIR}/"


def record_name(key_path: str, seq: int) -> str:
    return f"{log_prefix(key_path)}{seq:020d}.json"


def key_paths(backend: Backend) -> list[str]:
    """The encoded path of every key that has a log, sorted."""
    marker = f"/{LOG_DIR}/"
    paths = set()
    for info in backend.list(KEYS_PREFIX):
        head, sep, _ = info.name[len(KEYS_PREFIX):].partition(marker)
        if sep:
            paths.add(head)
    return sorted(paths)


def parts_prefix(key_path: str, seq: int | None = None) -> str:
    """Where rank parts of distributed snapshot ``seq`` (or of every seq) live."""
    base = f"{KEYS_PREFIX}{key_path}/{PARTS_DIR}/"
    return base if seq is None else f"{base}{seq:020d}/"


def part_name(key_path: str, seq: int, rank: int) -> str:
    return f"{parts_prefix(key_path, seq)}{rank:06d}.json"


def seq_from_name(name: str) -> int | None:
    """The seq of a record object name, or None when the name is not a record's."""
    base = name.rsplit("/", 1)[-1]
    stem, dot, ext = base.partition(".")
    if ext != "json" or len(stem) != 20 or not stem.isdigit():
        return None
    return int(stem)


@dataclass(frozen=True)
class Record:
    """One slot-log record. ``manifest`` is set for ``snap`` records."""

    seq: int
    kind: RecordKind
    epoch: int
    key: tuple[str, ...]
    created_at: str
    body: dict[str, Any]
    manifest: Manifest | None = None


def writer_identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def encode_record(kind: RecordKind, *, key: Key, seq: int, epoch: int,
                  body: dict[str, Any] | None = None) -> bytes:
    doc: dict[str, Any] = {
        "schema": RECORD_SCHEMA,
        "kind": kind.value,
        "seq": seq,
        "epoch": epoch,
        "key": list(key.components),
        "created_at": format_timestamp(),
        "writer": writer_identity(),
    }
    doc.update(body or {})
    return dumps(doc)


def decode_record(data: bytes, *, seq: int) -> Record:
    """Parse a record; a ``snap`` record's manifest is validated too.

    Raises :class:`CorruptSnapshot` when the record cannot be trusted.
    """
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("schema") != RECORD_SCHEMA:
            raise ValueError(
                f"unknown record schema {doc.get('schema')!r} (this cairn reads "
                f"{RECORD_SCHEMA}); upgrade cairn to read it"
            )
        kind = RecordKind(doc["kind"])
        if doc["seq"] != seq:
            raise ValueError(f"record says seq {doc['seq']} but is stored at seq {seq}")
        record = Record(seq=seq, kind=kind, epoch=int(doc["epoch"]), key=tuple(doc["key"]),
                        created_at=str(doc["created_at"]), body=doc)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptSnapshot(f"record at seq {seq} is unreadable: {e}", seq=seq) from None
    if kind is RecordKind.SNAP:
        manifest = manifest_from_json(doc.get("manifest"), seq=seq)
        if manifest.seq != seq:
            raise CorruptSnapshot(f"manifest at seq {seq} claims seq {manifest.seq}", seq=seq)
        record = Record(**{**record.__dict__, "manifest": manifest})
    return record


# Snapshot records remembered by content (below): more than the three a key keeps, so a
# start that lists the log three times parses each once, however many tries' open records
# lie between them.
_CACHE_RECORDS = 8
_cache: OrderedDict[tuple[str, int], Record] = OrderedDict()
_cache_lock = threading.Lock()


def _decoded(data: bytes, seq: int) -> Record:
    """:func:`decode_record`, remembered by the record's content: a try's start reads the
    same records three times (the parent, the previous try's summary, the snapshots to
    restore), and a 1 GiB process image's manifest is 1.6 MB of JSON. Keyed by the bytes'
    digest, never by the name, so a record read again is the record as stored now; a record
    that does not decode raises every time (failures are not remembered). The manifests'
    chunk tables are decoded only when read (:class:`~cairn.store.manifest.FileEntry`), so
    memory stays bounded by a few records' JSON. Thread-safe."""
    name = (digest(data), seq)
    with _cache_lock:
        record = _cache.get(name)
        if record is not None:
            _cache.move_to_end(name)
            return record
    record = decode_record(data, seq=seq)
    if record.manifest is None:
        return record  # small: parsed again each time, never pushing a snapshot out
    with _cache_lock:
        _cache[name] = record
        while len(_cache) > _CACHE_RECORDS:
            _cache.popitem(last=False)
    return record


class SlotLog:
    """Read and append one key's log. Thread-safe for reads; an :class:`AttemptLog` appends."""

    def __init__(self, backend: Backend, key: Key | str) -> None:
        """``key`` is a :class:`Key` or an already encoded key path (as listings give)."""
        self.backend = backend
        self.key = key
        self.path = key.path if isinstance(key, Key) else key

    def seqs(self) -> list[int]:
        """Every seq present, ascending."""
        out = []
        for info in self.backend.list(log_prefix(self.path)):
            seq = seq_from_name(info.name)
            if seq is not None and info.name == record_name(self.path, seq):
                out.append(seq)
        return sorted(out)

    def read(self, seq: int) -> Record:
        try:
            data = self.backend.read(record_name(self.path, seq))
        except NotFound:
            raise NotFound(f"key {self.key}: no record at seq {seq}") from None
        return _decoded(bytes(data), seq)

    def records(self) -> list[Record]:
        """Every readable record, ascending; unreadable ones are logged and left out."""
        return list(reversed(list(self.newest_first())))

    def newest_first(self) -> Iterator[Record]:
        """Readable records from the tail back, read lazily (stop early to read few)."""
        for seq in reversed(self.seqs()):
            try:
                yield self.read(seq)
            except NotFound:
                continue  # pruned between list and read
            except CorruptSnapshot as e:
                log.warning("key %s: skipping %s", self.key, e)

    def _key(self) -> Key:
        if not isinstance(self.key, Key):
            raise StoreError("appending to a log needs the Key, not only its encoded path")
        return self.key

    def open_attempt(self, *, note: dict[str, Any] | None = None) -> AttemptLog:
        """Create an ``open`` record at the first free seq and return the attempt's log."""
        for _ in range(_OPEN_RETRIES):
            seqs = self.seqs()
            seq = (seqs[-1] + 1) if seqs else 1
            data = encode_record(RecordKind.OPEN, key=self._key(), seq=seq, epoch=seq,
                                 body={"note": note or {}})
            try:
                self.backend.create(record_name(self.path, seq), data)
            except AlreadyExists:
                continue
            return AttemptLog(self, epoch=seq)
        raise StoreError(f"key {self.key}: could not open an attempt; too many concurrent writers")


class AttemptLog:
    """One attempt's appends. Only ever creates its own last seq + 1; fenced on a conflict.

    Not thread-safe: one thread appends (the store's writer serialises commits).
    """

    def __init__(self, log: SlotLog, *, epoch: int, last_seq: int | None = None) -> None:
        self.log = log
        self.epoch = epoch
        self.last_seq = epoch if last_seq is None else last_seq
        self.fenced = False

    def catch_up(self) -> None:
        """Adopt this attempt's own records past ``last_seq`` (written by an earlier process of
        the same attempt that died before it could say so); stop at another attempt's record,
        which means this attempt is fenced."""
        for seq in self.log.seqs():
            if seq <= self.last_seq:
                continue
            try:
                record = self.log.read(seq)
            except (NotFound, CorruptSnapshot):
                return
            if record.epoch != self.epoch:
                self.fenced = True
                return
            self.last_seq = seq

    @property
    def next_seq(self) -> int:
        return self.last_seq + 1

    def append(self, kind: RecordKind, body: dict[str, Any]) -> int:
        """Create the next record. Returns its seq; raises :class:`Fenced` on a conflict."""
        if self.fenced:
            raise Fenced(f"key {self.log.key}: this attempt (epoch {self.epoch}) is fenced")
        seq = self.next_seq
        data = encode_record(kind, key=self.log._key(), seq=seq, epoch=self.epoch, body=body)
        try:
            self.log.backend.create(record_name(self.log.path, seq), data)
        except AlreadyExists:
            self.fenced = True
            raise Fenced(
                f"key {self.log.key}: seq {seq} was taken by another attempt, so this one "
                f"(epoch {self.epoch}) has been superseded and must stop"
            ) from None
        self.last_seq = seq
        return seq
