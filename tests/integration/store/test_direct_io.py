"""Packs align large chunks so a local restore can read them with O_DIRECT, and it does: the
pages it reads never enter the page cache (checked with ``mincore``, not assumed)."""

from __future__ import annotations

import errno
import os
import random
from collections import defaultdict

import pytest

from cairn.store import Key, Manifest, Store, StoreSettings
from cairn import open_store
from cairn.store.aligned import DIRECT_IO_ALIGN, DIRECT_IO_MIN, aligned_buffer
from cairn.store.sealing import TAG_BYTES
from tests.support.pagecache import evict, pack_files, require_page_cache, resident_pages

KEY = Key(("dag", "train", "run-1", "0"))
FILES = {  # small and large files, none a multiple of 4 KiB, in the order they are added
    "a.json": b'{"a": 1}',
    "tensors/000000": random.Random(1).randbytes(300_001),
    "tensors/000001": random.Random(2).randbytes(70_001),
    "tensors/000002": random.Random(3).randbytes(1000),
    "tensors/000003": random.Random(4).randbytes(200_003),
}


def snapshot(store: Store) -> Manifest:
    with store.open_attempt(KEY).snapshot() as snap:
        for path, data in FILES.items():
            snap.add_bytes(path, data)
        return snap.commit(step=1)


def test_large_chunks_start_aligned_and_small_ones_pack_densely(store: Store) -> None:
    manifest = snapshot(store)
    by_pack = defaultdict(list)
    for chunk in manifest.chunk_refs():
        by_pack[chunk.pack].append(chunk)
    padding = 0
    tail = TAG_BYTES if store.encrypted else 0  # an encrypted store's tag after each chunk
    for pack, chunks in by_pack.items():
        end = 0
        for chunk in sorted(chunks, key=lambda c: c.offset):
            if chunk.size >= DIRECT_IO_MIN:
                expected = -(-end // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
            else:
                expected = end
            assert chunk.offset == expected, (pack, chunk)
            padding += chunk.offset - end
            end = chunk.offset + chunk.size + tail
        assert store.backend.stat(pack).size == end
    assert padding > 0, "the files were chosen so that some chunk needed padding"
    assert manifest.padding_bytes == padding
    assert manifest.bytes_written == sum(len(d) for d in FILES.values())


@pytest.fixture()
def local_store(tmp_path) -> Store:  # noqa: ANN001
    require_page_cache(str(tmp_path))
    store = open_store(str(tmp_path / "store"),
                       settings=StoreSettings(max_chunk_bytes=64 << 10, pack_bytes=256 << 10))
    yield store
    store.close()


def read_all(store: Store, manifest: Manifest) -> dict[str, bytes]:
    buffers = {path: memoryview(aligned_buffer(len(data)))[:len(data)]
               for path, data in FILES.items()}
    store.reader(manifest).read_files_into(list(buffers.items()))
    return {path: bytes(view) for path, view in buffers.items()}


def test_a_local_restore_into_aligned_memory_bypasses_the_page_cache(local_store: Store) -> None:
    manifest = snapshot(local_store)
    packs = pack_files(local_store, manifest)
    for path in packs:
        evict(path)
    assert read_all(local_store, manifest) == FILES
    small = [c for c in manifest.chunk_refs() if c.size < DIRECT_IO_MIN]
    # Only the small chunks went through the cache, and no readahead around them.
    assert 0 < sum(resident_pages(p) for p in packs) <= sum(c.size // 4096 + 2 for c in small)
    direct = sum(c.size for c in manifest.chunk_refs() if c.size >= DIRECT_IO_MIN)

    # The same read into memory that is not aligned must go through the cache: the check
    # above can fail.
    for path in packs:
        evict(path)
    for path, data in FILES.items():
        view = memoryview(bytearray(len(data) + 1))[1:]
        local_store.reader(manifest).read_files_into([(path, view)])
        assert bytes(view) == data
    assert sum(resident_pages(p) for p in packs) * DIRECT_IO_ALIGN >= direct


def test_a_filesystem_that_refuses_o_direct_is_read_through_the_cache(
        local_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulates tmpfs before Linux 6.6 or a FUSE mount: open(O_DIRECT) fails with EINVAL.
    manifest = snapshot(local_store)
    real_open = os.open
    refused = []

    def open_refusing_direct(path, flags, *args):  # noqa: ANN001, ANN202
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr("cairn.store.local.os.open", open_refusing_direct)
    assert read_all(local_store, manifest) == FILES
    assert len(refused) == 1, "one refusal is remembered: no further O_DIRECT attempts"
    assert read_all(local_store, manifest) == FILES
    assert len(refused) == 1


def test_a_streamed_read_goes_through_the_page_cache_sealed_or_not(
        tmp_path, store_secret, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """``iter_file`` and ``verify`` stream: they keep the page cache and its readahead (ADR
    0016). An encrypted store stages each range before decrypting it out of place; that
    staging must not be the aligned scratch memory that a local backend reads with O_DIRECT."""
    require_page_cache(str(tmp_path))
    store = open_store(str(tmp_path / "store"), secret=store_secret,
                       settings=StoreSettings(max_chunk_bytes=64 << 10, pack_bytes=256 << 10))
    direct = []
    real_open = os.open

    def open_noting_direct(path, flags, *args):  # noqa: ANN001, ANN202
        if flags & os.O_DIRECT:
            direct.append(path)
        return real_open(path, flags, *args)

    with store:
        manifest = snapshot(store)
        packs = pack_files(store, manifest)
        monkeypatch.setattr("cairn.store.local.os.open", open_noting_direct)
        for path in packs:
            evict(path)
        reader = store.reader(manifest)
        assert {path: b"".join(bytes(p) for p in reader.iter_file(path))
                for path in FILES} == FILES
        reader.verify()
        assert direct == [], f"a streamed read opened {len(direct)} packs with O_DIRECT"
        large = sum(c.size for c in manifest.chunk_refs() if c.size >= DIRECT_IO_MIN)
        assert sum(resident_pages(p) for p in packs) * DIRECT_IO_ALIGN >= large

        # The check can fail: a restore into aligned memory does open the packs with O_DIRECT.
        read_all(store, manifest)
        assert direct, "the restore read no pack with O_DIRECT: the check above proves nothing"
