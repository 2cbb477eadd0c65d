"""SnapshotReader.read_files_into: whole files straight into the caller's buffers, every chunk
verified, one pipeline across files; damage raises CorruptSnapshot naming the chunk."""

from __future__ import annotations

import random
import threading

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store import Key, Manifest, Store
from cairn.store.reader import SnapshotReader
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


def test_a_slow_read_does_not_hold_back_the_reads_after_it(store: Store) -> None:
    """Reads land in buffers of their own, so a new one starts whenever any ends: with two in
    flight, the reads after a stalled first one still run. (A reader that waited on the oldest
    read would start nothing while the first stalls, and the first would give up waiting.)"""
    manifest = snapshot(store)
    backend = store.backend
    read = backend.read_range_into
    lock = threading.Lock()
    calls = 0
    others_done = 0
    two_others_done = threading.Event()
    first_waited: list[bool] = []

    def read_range_into(name: str, offset: int, buffer: memoryview) -> int:
        nonlocal calls, others_done
        with lock:
            calls += 1
            first = calls == 1
        if first:
            first_waited.append(two_others_done.wait(timeout=10))
            return read(name, offset, buffer)
        got = read(name, offset, buffer)
        with lock:
            others_done += 1
            if others_done >= 2:
                two_others_done.set()
        return got

    reader = SnapshotReader(backend, manifest, pool=store.pool, prefetch=2, sealer=store.sealer)
    buffers = {path: bytearray(len(data)) for path, data in FILES.items()}
    backend.read_range_into = read_range_into  # type: ignore[method-assign]
    try:
        reader.read_files_into([(p, memoryview(b)) for p, b in buffers.items()])
    finally:
        del backend.read_range_into
    assert first_waited == [True], "no read started while the first one stalled"
    assert {p: bytes(b) for p, b in buffers.items()} == FILES
