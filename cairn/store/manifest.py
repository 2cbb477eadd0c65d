"""Manifests: what one snapshot holds, as versioned JSON. Parsing validates everything.

A manifest lists files, each as an ordered list of chunk references
(:class:`~cairn.store.chunktable.ChunkRef`): where the bytes live (``pack`` object and
``offset``, and for a delta chunk its base's), how many (``size``) and what they must hash to
(``digest``). Nothing in a manifest is ever executed or unpickled.

Schema ``cairn.manifest/2`` (written since issue 16; ADR 0022) lists the packs once and each
file's chunks as a dense binary table (:mod:`cairn.store.chunktable`), base64::

    {"schema": "cairn.manifest/2", "key": [...], "seq": 7, "epoch": 5, "parent": 6,
     "created_at": "2026-11-29T15:00:00.000000Z", "mode": "files",
     "packs": ["packs/ab/<id>", ...],
     "files": [{"path": "a/b.bin", "size": 3, "mode": 420, "chunks": "<base64 table>"}],
     "metadata": {"step": 100, "bytes_logical": 3, "bytes_written": 3,
                  "producer": {...}, "compat": {...}, "user": {...}}}

Schema ``cairn.manifest/1`` (still read) had no ``packs`` and each chunk as
``["<blake3 hex>", size, "packs/ab/<id>", offset]``.
"""

from __future__ import annotations

import enum
import functools
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cairn.exceptions import CorruptSnapshot
from cairn.store import chunktable
from cairn.store.chunktable import ChunkRef
from cairn.store.hashing import is_digest

MANIFEST_SCHEMA = "cairn.manifest/2"
MANIFEST_SCHEMA_V1 = "cairn.manifest/1"
# Far beyond any real snapshot; a manifest claiming more is garbage, not a big snapshot.
MAX_FILE_BYTES = 1 << 50
MAX_CHUNK_BYTES = 1 << 32


class SnapshotMode(str, enum.Enum):
    """What a snapshot captured."""

    FILES = "files"  # files put by `cairn put` or the API
    PROCESS = "process"  # a CRIU process image
    STATE = "state"  # framework state (torch)


class _Table(NamedTuple):
    """A schema-2 chunk table as the manifest holds it, decoded at first use."""

    text: object
    packs: list[str]
    seq: int | None


class FileEntry:
    """One file of a snapshot: its path, size, recorded mode and chunks.

    Immutable. A file parsed from a schema-2 manifest keeps its chunk table as text until
    :attr:`chunks` is first read (ADR 0044): a try's start parses every kept snapshot's
    manifest to choose one, and decoding a 1 GiB image's ~29,000 chunk references took
    most of that time for snapshots it then never read. The first read decodes and
    validates the table (every field in range, the chunks adding up to ``size``) and
    raises :class:`CorruptSnapshot` naming the seq when it does not; so a snapshot whose
    table is bad is skipped wherever its chunks are first looked at (``Store.latest_good``
    checks every chunk's pack before it returns a manifest). Any thread may read it; two
    that decode at once get equal tuples.
    """

    __slots__ = ("path", "size", "mode", "_chunks", "_table")

    path: str
    size: int
    mode: int | None  # as recorded; a restore applies ``mode & 0o777`` only

    def __init__(self, path: str, size: int, chunks: tuple[ChunkRef, ...] | None = None,
                 mode: int | None = None, *, table: _Table | None = None) -> None:
        if (chunks is None) == (table is None):
            raise TypeError("a FileEntry needs its chunks or its table, not both")
        set_ = object.__setattr__
        set_(self, "path", path)
        set_(self, "size", size)
        set_(self, "mode", mode)
        set_(self, "_chunks", chunks)
        set_(self, "_table", table)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"FileEntry is immutable; cannot set {name!r}")

    @property
    def chunks(self) -> tuple[ChunkRef, ...]:
        chunks = self._chunks
        if chunks is None:
            chunks = self._decode()
            object.__setattr__(self, "_chunks", chunks)
        return chunks

    def _decode(self) -> tuple[ChunkRef, ...]:
        table = self._table
        assert table is not None
        try:
            chunks = tuple(_table_chunks(table.text, table.packs, self.path))
            total = sum(chunk.size for chunk in chunks)
            _expect(total == self.size,
                    f"chunks of {self.path} add up to {total} bytes, not {self.size}")
        except ValueError as e:
            raise CorruptSnapshot(_invalid(table.seq, e), seq=table.seq) from None
        return chunks

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileEntry):
            return NotImplemented
        return ((self.path, self.size, self.mode, self.chunks)
                == (other.path, other.size, other.mode, other.chunks))

    def __hash__(self) -> int:
        return hash((self.path, self.size, self.mode))

    def __repr__(self) -> str:
        chunks = (f"{len(self._chunks)} chunks" if self._chunks is not None
                  else "chunks not decoded yet")
        return f"FileEntry(path={self.path!r}, size={self.size}, mode={self.mode!r}, {chunks})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FileEntry, (self.path, self.size, self.chunks, self.mode))

    def to_json(self, pack_index: dict[str, int]) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "size": self.size}
        if self.mode is not None:
            out["mode"] = self.mode
        out["chunks"] = chunktable.encode(self.chunks, pack_index)
        return out


@dataclass(frozen=True)
class Manifest:
    key: tuple[str, ...]
    seq: int
    epoch: int
    parent: int | None
    created_at: str
    mode: SnapshotMode
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_logical(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_written(self) -> int:
        """Chunk bytes this snapshot added to the store (after deduplication)."""
        return int(self.metadata.get("bytes_written", 0))

    @property
    def padding_bytes(self) -> int:
        """Zero bytes written before chunks to align them in their packs (0 when unrecorded)."""
        return int(self.metadata.get("padding_bytes", 0))

    @property
    def step(self) -> int | None:
        return self.metadata.get("step")

    def decoded(self) -> Manifest:
        """This manifest after decoding every file's chunk table now (they are decoded at
        first use otherwise); raises :class:`CorruptSnapshot` for a table that is bad."""
        for entry in self.files:
            entry.chunks
        return self

    def chunk_refs(self) -> Iterator[ChunkRef]:
        for entry in self.files:
            yield from entry.chunks

    def packs(self) -> set[str]:
        """Every pack a restore of this snapshot reads (deltas' bases included)."""
        return set(self._pack_ends)

    def pack_ends(self) -> dict[str, int]:
        """Every pack a restore reads, to the end of the last stored byte it reads there
        (chunk bytes; a sealed pack's tag comes after): a new dict each call, computed once
        per manifest (a try's start computes it while the host checks run;
        ``Store.check_present`` reads it)."""
        return dict(self._pack_ends)

    @functools.cached_property
    def _pack_ends(self) -> dict[str, int]:
        ends: dict[str, int] = {}
        get = ends.get
        for chunk in self.chunk_refs():
            # Hot loop (29,000 chunks for 1 GiB): a full chunk's one extent inline.
            if not chunk.delta_mask:
                end = chunk.offset + chunk.size
                if end > get(chunk.pack, 0):
                    ends[chunk.pack] = end
                continue
            for pack, offset, length in chunk.extents():
                if offset + length > get(pack, 0):
                    ends[pack] = offset + length
        return ends

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def to_json(self) -> dict[str, Any]:
        packs = sorted(self.packs())
        index = {name: i for i, name in enumerate(packs)}
        return {
            "schema": MANIFEST_SCHEMA,
            "key": list(self.key),
            "seq": self.seq,
            "epoch": self.epoch,
            "parent": self.parent,
            "created_at": self.created_at,
            "mode": self.mode.value,
            "packs": packs,
            "files": [f.to_json(index) for f in self.files],
            "metadata": self.metadata,
        }


def check_relative_path(path: object) -> str:
    """``path`` if it is a safe relative path inside a snapshot; otherwise ValueError."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"file path {path!r} is empty or not text")
    if "\x00" in path:
        raise ValueError(f"file path {path!r} contains NUL")
    if path.startswith("/") or posixpath.isabs(path):
        raise ValueError(f"file path {path!r} is absolute; snapshot paths are relative")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"file path {path!r} has an empty, '.' or '..' part")
    return path


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _int(value: object, what: str, *, lo: int = 0, hi: int = MAX_FILE_BYTES) -> int:
    _expect(isinstance(value, int) and not isinstance(value, bool), f"{what} is not an integer")
    assert isinstance(value, int)
    _expect(lo <= value <= hi, f"{what} {value} is out of range {lo}..{hi}")
    return value


def manifest_from_json(doc: object, *, seq: int | None = None) -> Manifest:
    """Parse and validate a manifest. Raises :class:`CorruptSnapshot` saying what is wrong."""
    try:
        return _parse(doc, seq)
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptSnapshot(_invalid(seq, e), seq=seq) from None


def _invalid(seq: int | None, error: Exception) -> str:
    return f"manifest{'' if seq is None else f' of seq {seq}'} is invalid: {error}"


def _parse(doc: object, seq: int | None) -> Manifest:
    _expect(isinstance(doc, dict), "manifest is not a JSON object")
    assert isinstance(doc, dict)
    schema = doc.get("schema")
    if schema not in (MANIFEST_SCHEMA, MANIFEST_SCHEMA_V1):
        raise ValueError(
            f"unknown manifest schema {schema!r} (this cairn reads {MANIFEST_SCHEMA_V1} and "
            f"{MANIFEST_SCHEMA}); it was written by a newer cairn: upgrade cairn to read it"
        )
    packs: list[str] = []
    if schema == MANIFEST_SCHEMA:
        packs = doc["packs"]
        _expect(isinstance(packs, list), "packs is not a list")
        for pack in packs:
            if not _good_pack(pack):
                raise ValueError(f"the manifest names a bad pack {pack!r}")
    key = doc["key"]
    _expect(isinstance(key, list) and key and all(isinstance(c, str) for c in key), "key is invalid")
    parent = doc.get("parent")
    if parent is not None:
        parent = _int(parent, "parent")
    files: list[FileEntry] = []
    seen: set[str] = set()
    raw_files = doc["files"]
    _expect(isinstance(raw_files, list), "files is not a list")
    for raw in raw_files:
        _expect(isinstance(raw, dict), "a file entry is not an object")
        path = check_relative_path(raw["path"])
        _expect(path not in seen, f"file path {path!r} appears twice")
        seen.add(path)
        size = _int(raw["size"], f"size of {path}")
        mode = raw.get("mode")
        if mode is not None:
            # Recorded as the writer saw it (a snapshot of a setuid file stays readable);
            # every restore applies only the 0o777 bits (cairn.store.confined.masked_mode).
            mode = _int(mode, f"mode of {path}", hi=0o7777)
        if schema == MANIFEST_SCHEMA:
            text = raw["chunks"]
            _expect(isinstance(text, str), f"chunks of {path}: the chunk table is not text")
            files.append(FileEntry(path, size, mode=mode, table=_Table(text, packs, seq)))
            continue
        chunks = _v1_chunks(raw["chunks"], path)
        total = sum(chunk.size for chunk in chunks)
        _expect(total == size, f"chunks of {path} add up to {total} bytes, not {size}")
        files.append(FileEntry(path, size, tuple(chunks), mode))
    metadata = doc.get("metadata", {})
    _expect(isinstance(metadata, dict), "metadata is not an object")
    return Manifest(
        key=tuple(key),
        seq=_int(doc["seq"], "seq"),
        epoch=_int(doc["epoch"], "epoch"),
        parent=parent,
        created_at=str(doc["created_at"]),
        mode=SnapshotMode(doc["mode"]),
        files=tuple(files),
        metadata=metadata,
    )


def _good_pack(pack: object) -> bool:
    return type(pack) is str and pack.startswith("packs/") and ".." not in pack


def _table_chunks(text: object, packs: list[str], path: str) -> list[ChunkRef]:
    try:
        return chunktable.decode(text, packs=packs, max_size=MAX_CHUNK_BYTES,
                                 max_offset=MAX_FILE_BYTES)
    except chunktable.TableError as e:
        raise ValueError(f"chunks of {path}: {e}") from None


def _v1_chunks(raw_chunks: object, path: str) -> list[ChunkRef]:
    _expect(isinstance(raw_chunks, list), f"chunks of {path} is not a list")
    assert isinstance(raw_chunks, list)
    chunks = []
    for c in raw_chunks:
        # Hot loop: test first, format messages only for the chunk that fails.
        if not (isinstance(c, list) and len(c) == 4):
            raise ValueError(f"a chunk of {path} is malformed")
        digest, csize, pack, offset = c
        if not is_digest(digest):
            raise ValueError(f"a chunk of {path} has a bad digest {digest!r}")
        if not (type(csize) is int and 0 <= csize <= MAX_CHUNK_BYTES):
            _int(csize, f"chunk size in {path}", hi=MAX_CHUNK_BYTES)
        if not _good_pack(pack):
            raise ValueError(f"a chunk of {path} names a bad pack {pack!r}")
        if not (type(offset) is int and 0 <= offset <= MAX_FILE_BYTES):
            _int(offset, f"chunk offset in {path}")
        chunks.append(ChunkRef(digest, csize, pack, offset))
    return chunks


def dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=False).encode("utf-8")
