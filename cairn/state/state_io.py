"""A state snapshot's files: writing one inline (:func:`save_state`) and reading one back,
verified, into fresh CPU memory (:func:`load_state`). Never pickled: the arrays are raw bytes
described by cairn's codec (:mod:`cairn.state.codec`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cairn.exceptions import CorruptSnapshot
from cairn.state.codec import (
    STATE_FILE,
    STATE_SCHEMA,
    ArrayHeader,
    cpu_bytes,
    flatten,
    array_indices,
    header_of,
    tensor_path,
    unflatten,
)
from cairn.state.staging import plan
from cairn.store import Manifest, SnapshotMode, Store
from cairn.store.reader import SnapshotReader
from cairn.store.aligned import DIRECT_IO_MIN, aligned_buffer


def save_state(store_attempt: Any, tree: dict[str, Any], *, step: int) -> Manifest:
    """Write ``tree`` as one state snapshot of ``store_attempt``; durable when it returns."""
    structure, arrays = flatten(tree)
    headers = [header_of(a).to_json() for a in arrays]
    with store_attempt.snapshot(mode=SnapshotMode.STATE) as snap:
        for index, array in enumerate(arrays):
            snap.add_bytes(tensor_path(index), cpu_bytes(array))
        doc = {"schema": STATE_SCHEMA, "step": step, "structure": structure, "arrays": headers}
        snap.add_bytes(STATE_FILE, json.dumps(doc, separators=(",", ":")).encode())
        return snap.commit(step=step)


@dataclass(frozen=True)
class StateDoc:
    """One part of a state snapshot as its ``state.json`` describes it (``prefix``: the part,
    ``rank-<r>/``, or "" for a snapshot of one process): the tree's structure and the header
    of each array the structure refers to by index. Parsed only, nothing of it trusted yet
    beyond the parse."""

    seq: int
    prefix: str
    structure: Any
    headers: tuple[ArrayHeader, ...]


def load_state(store: Store, manifest: Manifest, *, prefix: str = "",
               pieces: bool = True) -> dict[str, Any]:
    """Read and verify a whole state snapshot (``prefix``: one rank's part, ``rank-<r>/``)
    into CPU memory. ``pieces=False``: the pieces of sharded tensors are not read (a restore
    reads them through DCP, from every part): each :class:`~cairn.state.codec.Shard` holds a
    ``meta`` tensor of the piece's shape and dtype. Raises CorruptSnapshot when it does not
    verify or parse; a failure of the reading itself propagates as it is (see
    :mod:`cairn.store.verdicts`)."""
    reader = store.reader(manifest)
    doc = read_state_doc(reader, prefix=prefix)
    unread = set() if pieces else array_indices(doc.structure, tags=("$shard",))
    arrays = read_arrays(reader, doc, [i for i in range(len(doc.headers)) if i not in unread])
    for index in unread:
        header = doc.headers[index] if index < len(doc.headers) else None
        if header is None or header.kind != "torch":
            raise CorruptSnapshot(f"seq {manifest.seq}: {doc.prefix}{STATE_FILE}'s shard "
                                  f"{index} is not a torch array it describes", seq=manifest.seq)
        arrays[index] = torch.empty(header.shape, dtype=getattr(torch, header.dtype),
                                    device="meta")
    tree = unflatten(doc.structure, [arrays[i] for i in range(len(doc.headers))])
    if not isinstance(tree, dict) or "step" not in tree:
        raise CorruptSnapshot(f"seq {manifest.seq}: state has no step", seq=manifest.seq)
    return tree


def read_state_doc(reader: SnapshotReader, *, prefix: str = "") -> StateDoc:
    """The verified, parsed ``state.json`` of one part of the state snapshot ``reader``
    reads. Raises CorruptSnapshot when it is missing or does not verify or parse."""
    manifest = reader.manifest
    if manifest.mode is not SnapshotMode.STATE:
        raise CorruptSnapshot(f"seq {manifest.seq} is a {manifest.mode.value} snapshot, not "
                              "framework state", seq=manifest.seq)
    if not any(entry.path == prefix + STATE_FILE for entry in manifest.files):
        raise CorruptSnapshot(f"seq {manifest.seq}: {prefix}{STATE_FILE} is missing",
                              seq=manifest.seq)
    # Read outside the parsing's except: a library error while reading is no verdict on the
    # snapshot (cairn.store.verdicts), only what cairn's own parsing refuses is.
    raw = reader.read_file(prefix + STATE_FILE)
    try:
        doc = json.loads(raw)
        if doc.get("schema") != STATE_SCHEMA:
            raise CorruptSnapshot(f"state schema {doc.get('schema')!r} is unknown; upgrade cairn",
                                  seq=manifest.seq)
        headers = tuple(ArrayHeader.from_json(h) for h in doc["arrays"])
        structure = doc["structure"]
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise CorruptSnapshot(f"seq {manifest.seq}: {prefix}{STATE_FILE} is unreadable: {e}",
                              seq=manifest.seq) from None
    return StateDoc(seq=manifest.seq, prefix=prefix, structure=structure, headers=headers)


def read_arrays(reader: SnapshotReader, doc: StateDoc, indices: Iterable[int]) -> dict[int, Any]:
    """The arrays ``indices`` of ``doc``'s part, each read and verified into fresh CPU memory
    of its own (never into live objects: those are touched only once everything verified).
    Returns once every one is in place; raises CorruptSnapshot at a missing or bad one."""
    manifest = reader.manifest
    entries = {entry.path: entry for entry in manifest.files}
    arrays: dict[int, Any] = {}
    targets: list[tuple[str, memoryview]] = []
    for index in indices:
        if not 0 <= index < len(doc.headers):
            raise CorruptSnapshot(f"seq {manifest.seq}: {doc.prefix}{STATE_FILE} refers to "
                                  f"array {index}, which it does not describe", seq=manifest.seq)
        header = doc.headers[index]
        try:
            entry = entries[doc.prefix + tensor_path(index)]
        except KeyError:
            raise CorruptSnapshot(f"seq {manifest.seq}: {doc.prefix}{tensor_path(index)} is "
                                  "missing", seq=manifest.seq) from None
        if entry.size != header.nbytes:
            raise CorruptSnapshot(f"seq {manifest.seq}: {entry.path} holds {entry.size} bytes, "
                                  f"its header says {header.nbytes}", seq=manifest.seq)
        array = _empty_array(header, seq=manifest.seq)
        arrays[index] = array
        if header.nbytes:
            targets.append((entry.path, _byte_view(array)))
    reader.read_files_into(targets)
    return arrays


def _empty_array(header: ArrayHeader, *, seq: int) -> Any:
    """A fresh, uninitialised CPU tensor or ndarray as ``header`` describes it, allocated only
    after its byte count was checked against its shape and dtype."""
    dtype = np.dtype(header.dtype) if header.kind == "numpy" else getattr(torch, header.dtype)
    if math.prod(header.shape) * dtype.itemsize != header.nbytes:
        raise CorruptSnapshot(f"seq {seq}: header {header} is inconsistent: shape and dtype do "
                              f"not make {header.nbytes} bytes", seq=seq)
    memory = None
    if header.nbytes >= DIRECT_IO_MIN:
        # Page-aligned, so that a local store reads it with O_DIRECT; the array owns the mapping.
        try:
            memory = aligned_buffer(header.nbytes)
        except OSError:  # out of mappings (vm.max_map_count): read through the page cache
            memory = None
    if memory is None:
        if header.kind == "numpy":
            return np.empty(header.shape, dtype=dtype)
        return torch.empty(header.shape, dtype=dtype)
    if header.kind == "numpy":
        return np.frombuffer(memory, dtype=dtype, count=math.prod(header.shape)).reshape(header.shape)
    raw = torch.frombuffer(memory, dtype=torch.uint8, count=header.nbytes)
    return raw.view(dtype).reshape(header.shape)


def _byte_view(array: Any) -> memoryview:
    """A writable view of a C-contiguous, non-empty array's bytes."""
    if isinstance(array, np.ndarray):
        return memoryview(array.reshape(-1).view(np.uint8))
    return memoryview(array.reshape(-1).view(torch.uint8).numpy())


def staged_size(manifest: Manifest, prefix: str) -> int:
    """The staging bytes of the state a snapshot holds (its arrays laid out by :func:`plan`)."""
    start = prefix + "tensors/"
    return plan([entry.size for entry in manifest.files if entry.path.startswith(start)])[1]


def with_headroom(nbytes: int) -> int:
    """A staging buffer's size for a state of ``nbytes``: room for a state that grows."""
    return nbytes + nbytes // 8
