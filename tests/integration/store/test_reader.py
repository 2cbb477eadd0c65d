"""SnapshotReader.read_files_into: whole files straight into the caller's buffers, every chunk
verified, one pipeline across files; damage raises CorruptSnapshot naming the chunk."""

from __future__ import annotations

import random

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store import Key, Manifest, Store
from tests.support import tamper

KEY = Key(("dag", "train", "run-1", "0"))
FILES = {
    "tensors/000000": random.Random(1).randbytes(700_000),  # many 64 KiB chunks, several packs
    "tensors/000001": random.Random(2).randbytes(1000),
    "tensors/000002": b"",
    "state.json": b'{"step": 1}',
}


def snapshot(store: Store) -> Manifest:
    attempt = store.open_attempt(KEY)
    with attempt.snapshot() as snap:
        for path, data in FILES.items():
            snap.add_bytes(path, data)
        return snap.commit(step=1)


def read_all(store: Store, manifest: Manifest) -> dict[str, bytearray]:
    buffers = {path: bytearray(len(data)) for path, data in FILES.items()}
    store.reader(manifest).read_files_into([(p, memoryview(b)) for p, b in buffers.items()])
    return buffers


def test_whole_files_land_in_the_callers_buffers(store: Store) -> None:
    manifest = snapshot(store)
    assert len({c.pack for c in manifest.file("tensors/000000").chunks}) > 1
    seen: list[int] = []
    buffers = {path: bytearray(len(data)) for path, data in FILES.items()}
    store.reader(manifest).read_files_into([(p, memoryview(b)) for p, b in buffers.items()],
                                           progress=seen.append)
    assert {p: bytes(b) for p, b in buffers.items()} == FILES
    assert sum(seen) == sum(len(d) for d in FILES.values())


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damage_raises_naming_the_chunk(store: Store, damage: str) -> None:
    manifest = snapshot(store)
    chunk = manifest.file("tensors/000000").chunks[5]
    if damage == "flip":
        tamper.flip_byte(store.backend, chunk.pack, chunk.offset + 3)
    elif damage == "truncate":
        tamper.truncate(store.backend, chunk.pack, chunk.offset + 10)
    else:
        store.backend.delete(chunk.pack)
    with pytest.raises(CorruptSnapshot) as caught:
        read_all(store, manifest)
    assert caught.value.seq == manifest.seq
    if damage == "flip":  # truncating or deleting the pack may hit a chunk before it first
        assert caught.value.digest == chunk.digest


def test_buffers_must_be_writable_and_exactly_the_files_size(store: Store) -> None:
    manifest = snapshot(store)
    reader = store.reader(manifest)
    with pytest.raises(ValueError, match="1000 bytes"):
        reader.read_files_into([("tensors/000001", memoryview(bytearray(999)))])
    with pytest.raises(ValueError, match="read-only"):
        reader.read_files_into([("tensors/000001", memoryview(bytes(1000)))])
    with pytest.raises(KeyError):
        reader.read_files_into([("nope", memoryview(bytearray(1)))])
