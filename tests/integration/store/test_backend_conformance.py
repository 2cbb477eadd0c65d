"""The storage conformance suite: every backend runs every test here (see ``backend`` fixture).

It pins the contracts of :mod:`cairn.store.backend` that the slot log, packing and GC build on.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from cairn.exceptions import AlreadyExists, NotFound, PreconditionFailed
from cairn.store.backend import Backend


def test_create_then_read(backend: Backend) -> None:
    backend.create("a/b/c.json", b'{"x": 1}')
    assert backend.read("a/b/c.json") == b'{"x": 1}'
    assert backend.stat("a/b/c.json").size == 8


def test_create_is_create_only(backend: Backend) -> None:
    backend.create("log/00000000000000000001.json", b"first")
    with pytest.raises(AlreadyExists):
        backend.create("log/00000000000000000001.json", b"second")
    assert backend.read("log/00000000000000000001.json") == b"first"


def test_concurrent_creates_exactly_one_wins(backend: Backend) -> None:
    winners: list[int] = []
    losers: list[int] = []
    barrier = threading.Barrier(8)

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            backend.create("race/seq", f"writer-{i}".encode())
            winners.append(i)
        except AlreadyExists:
            losers.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(losers) == 7
    assert backend.read("race/seq") == f"writer-{winners[0]}".encode()


def test_streaming_writer_is_invisible_until_commit(backend: Backend) -> None:
    payload = os.urandom(3 << 20)
    with backend.open_writer("packs/p1") as writer:
        for i in range(0, len(payload), 1 << 20):
            writer.write(payload[i : i + (1 << 20)])
        assert not [i for i in backend.list("packs/")]
        writer.commit()
    assert backend.read("packs/p1") == payload
    assert backend.read_range("packs/p1", 1000, 5000) == payload[1000:6000]
    assert backend.read_range("packs/p1", len(payload) - 10, 100) == payload[-10:]


def test_streaming_writer_is_create_only(backend: Backend) -> None:
    backend.create("packs/p2", b"one")
    with backend.open_writer("packs/p2") as writer:
        writer.write(b"two")
        with pytest.raises(AlreadyExists):
            writer.commit()
    assert backend.read("packs/p2") == b"one"


def test_aborted_writer_leaves_nothing(backend: Backend) -> None:
    with backend.open_writer("packs/p3") as writer:
        writer.write(b"partial")
    assert list(backend.list("packs/")) == []
    with pytest.raises(NotFound):
        backend.read("packs/p3")


def test_missing_objects_raise_not_found(backend: Backend) -> None:
    for call in (
        lambda: backend.read("nope"),
        lambda: backend.read_range("nope", 0, 1),
        lambda: backend.stat("nope"),
        lambda: backend.delete("nope"),
        lambda: backend.touch("nope"),
    ):
        with pytest.raises(NotFound):
            call()


def test_list_is_prefix_filtered_and_sorted(backend: Backend) -> None:
    names = ["k/log/00000000000000000010.json", "k/log/00000000000000000002.json",
             "k/logx", "kz/log/1", "other/1"]
    for name in names:
        backend.create(name, name.encode())
    listed = [info.name for info in backend.list("k/log/")]
    assert listed == ["k/log/00000000000000000002.json", "k/log/00000000000000000010.json"]
    assert [i.name for i in backend.list("k")] == sorted(names[:4])
    assert {i.size for i in backend.list("other/")} == {len(b"other/1")}


def _next_version_step(backend: Backend) -> None:
    """Let the backend's clock move on: a version may change only once per step (S3's
    ``LastModified`` is kept to the second)."""
    time.sleep(backend.version_resolution_seconds)


def test_touch_changes_version_and_guards_conditional_delete(backend: Backend) -> None:
    backend.create("packs/p4", b"data")
    before = backend.stat("packs/p4")
    _next_version_step(backend)
    backend.touch("packs/p4")
    after = backend.stat("packs/p4")
    assert after.version != before.version
    assert after.updated >= before.updated
    with pytest.raises(PreconditionFailed):
        backend.delete("packs/p4", if_version=before.version)
    assert backend.read("packs/p4") == b"data"
    backend.delete("packs/p4", if_version=after.version)
    with pytest.raises(NotFound):
        backend.stat("packs/p4")


def test_recreated_object_has_new_version(backend: Backend) -> None:
    backend.create("packs/p5", b"data")
    old = backend.stat("packs/p5").version
    backend.delete("packs/p5")
    _next_version_step(backend)
    backend.create("packs/p5", b"data")
    with pytest.raises(PreconditionFailed):
        backend.delete("packs/p5", if_version=old)


def test_empty_object(backend: Backend) -> None:
    backend.create("empty", b"")
    assert backend.read("empty") == b""
    assert backend.read_range("empty", 0, 10) == b""


def test_read_range_into_large_and_unaligned_ranges(backend: Backend) -> None:
    # Sizes and offsets on and off 4 KiB boundaries: the local backend reads the aligned
    # bulk of a large read with O_DIRECT and the rest through the page cache.
    from cairn.store.aligned import aligned_buffer

    data = os.urandom(300_001)
    backend.create("packs/ab/big", data)
    memory = memoryview(aligned_buffer(len(data) + 4096))
    for offset, length, at in [(0, 262_144, 0), (4096, 290_000, 0), (8192, 300_000, 0),
                               (3, 100_000, 0), (0, 100_000, 1), (299_000, 5000, 0)]:
        view = memory[at:at + length]
        got = backend.read_range_into("packs/ab/big", offset, view)
        assert got == min(length, len(data) - offset)
        assert bytes(view[:got]) == data[offset:offset + got]
