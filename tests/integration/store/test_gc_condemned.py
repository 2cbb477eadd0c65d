"""GC on a backend whose deletes a touch cannot guard (S3, through moto's server process, a
fake of S3): unused packs are condemned first and deleted a grace period later, and a writer
never reuses a condemned pack (cairn.store.condemned, ADR 0048). Each interleaving of
test_gc_race.py that S3 cannot guard with a version has its case here, plain and encrypted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from cairn import open_store
from cairn.store import Key, Store, StoreSettings
from cairn.store import writer as writer_module
from cairn.store.backend import ObjectInfo
from cairn.store.condemned import CONDEMNED_PREFIX
from tests.support import tamper

KEY = Key(("dag", "train", "run-1", "0"))
DATA = random.Random(11).randbytes(512_000)  # several distinct chunks in two packs


@pytest.fixture()
def s3_store(s3_bucket: str, store_secret) -> Iterator[Store]:  # noqa: ANN001 - a Secret or None
    store = open_store(f"s3://{s3_bucket}/gc", secret=store_secret,
                       settings=StoreSettings(max_chunk_bytes=64 << 10, pack_bytes=256 << 10))
    try:
        assert not store.backend.guarded_deletes
        yield store
    finally:
        store.close()


def setup_pruned_parent(store: Store, grace: float = 1.0):  # noqa: ANN201
    """S1 committed, its packs older than ``grace`` plus S3's one-second clock step, and S1
    pruned."""
    attempt = store.open_attempt(KEY)
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", DATA)
        s1 = snap.commit(step=1)
    time.sleep(grace + 1.2)
    store._delete_record(KEY, s1.seq)  # what retention does once newer snapshots exist
    return attempt, s1


def past_the_clock_step() -> None:
    """Let S3's one-second clock step pass: GC counts an object's age from the end of the
    second its ``LastModified`` names, so what was touched or condemned in this second is
    still young, even with no grace."""
    time.sleep(1.2)


def packs(store: Store) -> set[str]:
    return {info.name for info in store.backend.list("packs/")}


def test_an_unused_pack_is_condemned_then_deleted_a_grace_later(s3_store: Store) -> None:
    grace = 4.0  # a pass right after the first sees its condemnation young, however loaded
    _, s1 = setup_pruned_parent(s3_store, grace)
    dry = s3_store.gc(grace_seconds=grace, dry_run=True)
    assert sorted(dry.condemned) == sorted(s1.packs())
    assert list(s3_store.backend.list(CONDEMNED_PREFIX)) == []
    first = s3_store.gc(grace_seconds=grace)
    assert sorted(first.condemned) == sorted(s1.packs()) and first.deleted == []
    assert s1.packs() <= packs(s3_store)
    again = s3_store.gc(grace_seconds=grace)
    assert (again.condemned, again.deleted) == ([], [])
    assert again.packs_condemned_earlier == len(s1.packs())
    time.sleep(grace + 1.2)  # the grace plus the clock's step
    due = s3_store.gc(grace_seconds=grace)
    assert sorted(due.deleted) == sorted(s1.packs())
    assert packs(s3_store) == set()
    assert list(s3_store.backend.list(CONDEMNED_PREFIX)) == []


def test_a_writer_that_reused_a_pack_before_its_condemnation_keeps_it(s3_store: Store) -> None:
    """The race a version cannot guard on S3: the writer touches S1's packs, GC (no grace)
    condemns them anyway, the writer commits; the pass that would delete them sees the
    reference and spares them."""
    attempt, s1 = setup_pruned_parent(s3_store)
    snap = attempt.snapshot()
    snap.add_bytes("state.bin", DATA)
    assert snap.stats.bytes_written == 0, "the chunks were reused"
    past_the_clock_step()
    assert sorted(s3_store.gc(grace_seconds=0).condemned) == sorted(s1.packs())
    s2 = snap.commit(step=2)
    past_the_clock_step()
    due = s3_store.gc(grace_seconds=0)
    assert due.deleted == [] and due.packs_referenced == len(s1.packs())
    assert list(s3_store.backend.list(CONDEMNED_PREFIX)) == []
    assert s3_store.verify(KEY).ok
    assert s3_store.reader(s2).read_file("state.bin") == DATA


def test_a_writer_after_the_condemnation_writes_the_chunks_again(s3_store: Store) -> None:
    attempt, s1 = setup_pruned_parent(s3_store)
    assert sorted(s3_store.gc(grace_seconds=0).condemned) == sorted(s1.packs())
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", DATA)
        s2 = snap.commit(step=2)
    assert s2.bytes_written == len(DATA) and not s2.packs() & s1.packs()
    past_the_clock_step()
    due = s3_store.gc(grace_seconds=0)
    assert sorted(due.deleted) == sorted(s1.packs())
    assert s3_store.verify(KEY).ok
    assert s3_store.reader(s2).read_file("state.bin") == DATA


def reuse_between_head_and_delete(store: Store, monkeypatch: pytest.MonkeyPatch,
                                  hook: Callable[[], None]) -> None:
    """Run ``hook`` in the one window S3 cannot guard: after a delete's HEAD found the pack
    unchanged, before its DeleteObject (whose If-Match names the ETag, which a touch keeps)."""
    raw = tamper.raw(store.backend)
    original = raw.stat
    pending = [hook]

    def stat(name: str) -> ObjectInfo:
        info = original(name)
        if name.startswith("packs/") and pending:
            pending.pop()()
        return info

    monkeypatch.setattr(raw, "stat", stat)


@pytest.mark.parametrize("condemnations_read", [True, False])
def test_a_reuse_racing_the_delete_is_safe_only_because_writers_read_condemnations(
        s3_store: Store, monkeypatch: pytest.MonkeyPatch, condemnations_read: bool) -> None:
    """A writer reuses S1's condemned packs in the window between the deleting pass's HEAD
    and its DeleteObject. Reading the condemnations, it writes the chunks again and its
    snapshot verifies; the control, a writer that ignores them, reuses packs that are then
    deleted under its committed snapshot, so this test can fail."""
    attempt, s1 = setup_pruned_parent(s3_store)
    s3_store.gc(grace_seconds=0)
    past_the_clock_step()
    if not condemnations_read:
        monkeypatch.setattr(writer_module, "condemned_packs", lambda backend: frozenset())
    snap = attempt.snapshot()
    reuse_between_head_and_delete(s3_store, monkeypatch,
                                  lambda: snap.add_bytes("state.bin", DATA))
    due = s3_store.gc(grace_seconds=0)
    s2 = snap.commit(step=2)
    if condemnations_read:
        assert sorted(due.deleted) == sorted(s1.packs())
        assert s2.bytes_written == len(DATA)
        assert s3_store.verify(KEY).ok
        assert s3_store.reader(s2).read_file("state.bin") == DATA
    else:  # the pack whose window the reuse ran in is deleted (the others' HEADs saw the touch)
        assert due.deleted and set(due.deleted) <= s1.packs()
        assert s2.bytes_written == 0
        assert not s3_store.verify(KEY).ok
