"""GC racing a writer: retention has pruned S1, a writer reuses S1's chunks, GC runs, the writer
commits, and the snapshot still verifies, on every backend. Interleavings are forced by a
backend wrapper that runs the writer's step at the exact moment GC has listed the packs."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from cairn.store import Key, Store
from cairn.store.backend import Backend, ObjectInfo
from cairn.store.packs import PACKS_PREFIX

KEY = Key(("dag", "train", "run-1", "0"))
DATA = random.Random(7).randbytes(512_000)  # several distinct chunks in two packs


class ListHook:
    """Wraps a backend's ``list`` so that ``hook`` runs right after GC lists the packs."""

    def __init__(self, backend: Backend, hook: Callable[[], None]) -> None:
        self.backend = backend
        self.hook = hook
        self.original = backend.list

    def __enter__(self) -> None:
        def listing(prefix: str) -> Iterator[ObjectInfo]:
            items = list(self.original(prefix))
            if prefix == PACKS_PREFIX and self.hook is not None:
                hook, self.hook = self.hook, None
                hook()
            return iter(items)

        self.backend.list = listing  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        self.backend.list = self.original  # type: ignore[method-assign]


def setup_pruned_parent(store: Store):  # noqa: ANN201
    """S1 committed, its packs older than the grace, and S1 pruned by retention."""
    attempt = store.open_attempt(KEY)
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", DATA)
        s1 = snap.commit(step=1)
    time.sleep(1.2)  # older than the 1 s grace used below
    store._delete_record(KEY, s1.seq)  # what retention does once newer snapshots exist
    assert store.snapshots(KEY) == []
    return attempt, s1


def test_reuse_lands_between_gc_listing_and_delete(store: Store) -> None:
    attempt, s1 = setup_pruned_parent(store)
    snap = attempt.snapshot()
    with ListHook(store.backend, lambda: snap.add_bytes("state.bin", DATA)):
        report = store.gc(grace_seconds=1.0)
    assert snap.stats.bytes_written == 0, "the chunks were reused, not rewritten"
    assert sorted(report.raced) == sorted(s1.packs()), "every guarded delete lost to the touch"
    assert report.deleted == []
    s2 = snap.commit(step=2)
    assert store.verify(KEY).ok
    assert store.reader(s2).read_file("state.bin") == DATA


def test_reuse_after_gc_deleted_the_pack_writes_the_chunks_again(store: Store) -> None:
    attempt, s1 = setup_pruned_parent(store)
    report = store.gc(grace_seconds=1.0)
    assert sorted(report.deleted) == sorted(s1.packs())
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", DATA)
        s2 = snap.commit(step=2)
    assert s2.bytes_written == len(DATA)
    assert store.verify(KEY).ok
    assert store.reader(s2).read_file("state.bin") == DATA


def test_reuse_before_gc_keeps_pack_within_grace(store: Store) -> None:
    attempt, s1 = setup_pruned_parent(store)
    snap = attempt.snapshot()
    snap.add_bytes("state.bin", DATA)  # touches S1's packs now
    report = store.gc(grace_seconds=1.0)
    assert report.deleted == [] and report.packs_in_grace == len(s1.packs())
    snap.commit(step=2)
    assert store.verify(KEY).ok


def test_without_the_touch_gc_would_break_the_snapshot(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same interleaving with touching disabled loses data, so the tests above
    can fail."""
    attempt, _ = setup_pruned_parent(store)
    monkeypatch.setattr(store.backend, "touch", lambda name: None)
    snap = attempt.snapshot()
    with ListHook(store.backend, lambda: snap.add_bytes("state.bin", DATA)):
        report = store.gc(grace_seconds=1.0)
    assert report.deleted
    snap.commit(step=2)
    assert not store.verify(KEY).ok


def test_gc_keeps_referenced_and_young_packs(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", DATA)
        snap.commit(step=1)
    orphan = store.backend
    orphan.create(f"{PACKS_PREFIX}zz/orphan", b"garbage")
    report = store.gc(grace_seconds=3600)
    assert report.deleted == [] and report.packs_in_grace == 1
    report = store.gc(grace_seconds=0)
    assert report.deleted == [f"{PACKS_PREFIX}zz/orphan"]
    assert store.verify(KEY).ok
