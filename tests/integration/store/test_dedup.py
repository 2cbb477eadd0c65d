"""Dedup: the same data again writes almost nothing; changing 10% in runs writes about 10%."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cairn.store import Key, Store, StoreSettings
from cairn import open_store

KEY = Key(("dag", "train", "run-1", "0"))
MB = 1_000_000


def put(store: Store, data: bytes | bytearray, step: int):  # noqa: ANN201
    attempt = store.open_attempt(KEY)
    with attempt.snapshot() as snap:
        snap.add_bytes("data.bin", data)
        return snap.commit(step=step)


def random_bytes(size: int, seed: int) -> bytearray:
    return bytearray(np.random.default_rng(seed).bytes(size))


@pytest.mark.slow
def test_200_mb_twice_then_ten_percent_changed(tmp_path) -> None:
    store = open_store(str(tmp_path / "store"), settings=StoreSettings())
    data = random_bytes(200 * MB, seed=1)
    first = put(store, data, 1)
    assert first.bytes_written == len(data)
    second = put(store, data, 2)
    assert second.bytes_written < 0.001 * len(data)
    # Overwrite 10% of the data in 10 contiguous runs of 2 MB at random places.
    rng = random.Random(2)
    starts = sorted(rng.sample(range(0, 100), 10))
    for i in starts:
        offset = i * 2 * MB
        data[offset:offset + 2 * MB] = random_bytes(2 * MB, seed=100 + i)
    third = put(store, data, 3)
    ratio = third.bytes_written / len(data)
    assert 0.09 <= ratio <= 0.15, f"wrote {ratio:.1%} for a 10% change"
    assert store.reader(third).read_file("data.bin") == bytes(data)
    store.close()


def test_dedup_on_every_backend(store: Store) -> None:
    data = random_bytes(2 * MB, seed=3)
    assert put(store, data, 1).bytes_written == len(data)
    assert put(store, data, 2).bytes_written == 0
    data[500_000:700_000] = random_bytes(200_000, seed=4)
    third = put(store, data, 3)
    assert 200_000 <= third.bytes_written <= 200_000 + 2 * (64 << 10)
    assert store.reader(third).read_file("data.bin") == bytes(data)


def test_dedup_is_only_against_parent_and_own_uploads(store: Store) -> None:
    """A chunk another key wrote is not trusted: this key writes its own copy."""
    data = random_bytes(300_000, seed=5)
    other = store.open_attempt(Key(("other", "key")))
    with other.snapshot() as snap:
        snap.add_bytes("data.bin", data)
        snap.commit()
    assert put(store, data, 1).bytes_written == len(data)


@pytest.mark.parametrize("repeat_bytes", [None, 256 << 10], ids=["default", "small-bound"])
def test_a_chunk_a_file_holds_many_times_is_read_once_per_bound(
        store: Store, tmp_path, monkeypatch: pytest.MonkeyPatch, repeat_bytes: int | None) -> None:
    """Zeroed or repeated memory deduplicates to one chunk that a file refers to at many
    positions. A restore reads it once for up to RESTORE_MAX_REPEAT_BYTES of output, not once
    per reference (an eager restore of 1 GiB of repeated memory from a GCS server took 58.8 s
    that way), and every position still gets verified bytes."""
    from cairn.store import reader as reader_module

    if repeat_bytes is not None:
        monkeypatch.setattr(reader_module, "RESTORE_MAX_REPEAT_BYTES", repeat_bytes)
    block = random.Random(1).randbytes(64 << 10)  # one chunk (the store's max_chunk_bytes)
    data = block * 64 + random.Random(2).randbytes(64 << 10)
    manifest = put(store, data, 1)
    extents = {(c.pack, c.offset) for c in manifest.files[0].chunks}
    assert len(manifest.files[0].chunks) == 65 and len(extents) == 2

    reader = store.reader(manifest)
    reads: list[tuple[str, int]] = []
    real = reader.backend.read_range_into

    def counting(name: str, offset: int, buffer: memoryview) -> int:
        reads.append((name, offset))
        return real(name, offset, buffer)

    monkeypatch.setattr(reader.backend, "read_range_into", counting)
    reader.restore_to(tmp_path / "out")
    assert (tmp_path / "out" / "data.bin").read_bytes() == data
    restore_reads = len(reads)
    reads.clear()
    assert bytes(reader.read_chunks(manifest.files[0].chunks)) == data
    # The repeated chunk fills 64 positions: one read serves its first position and up to the
    # bound's worth more (default: all 64; a bound of 4 chunks: 5 positions, so 13 reads). The
    # other chunk takes one read more, or shares one when it lies close in the same pack.
    per_read = 1 + (64 if repeat_bytes is None else repeat_bytes // len(block))
    repeated_reads = -(-64 // per_read)
    for count in (restore_reads, len(reads)):
        assert repeated_reads <= count <= repeated_reads + 1, (count, repeated_reads)
