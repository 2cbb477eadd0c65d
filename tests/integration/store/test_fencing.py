"""Fencing as deterministic interleavings: a zombie attempt can never commit after a newer
attempt opened, and a ``done`` fences everyone, on every backend."""

from __future__ import annotations

import pytest

from cairn.exceptions import Fenced
from cairn.store import Key, Store
from cairn.store.slotlog import RecordKind

KEY = Key(("dag", "train", "run-1", "0"))


def commit(attempt, data: bytes, step: int):  # noqa: ANN001, ANN201
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", data)
        return snap.commit(step=step)


def test_zombie_passes_precheck_then_new_attempt_opens_then_zombie_is_refused(store: Store) -> None:
    zombie = store.open_attempt(KEY)
    commit(zombie, b"zombie-1" * 1000, step=1)
    # The zombie prepares its next snapshot and passes any pre-check it might make...
    snap = zombie.snapshot()
    snap.add_bytes("state.bin", b"zombie-2" * 1000)
    assert store.latest_good(KEY).epoch == zombie.epoch
    # ...then the retry opens (its worker thought the zombie dead)...
    retry = store.open_attempt(KEY)
    assert retry.epoch > zombie.log.last_seq
    assert retry.parent.step == 1
    # ...and the zombie's commit is refused, for good.
    with pytest.raises(Fenced, match="superseded"):
        snap.commit(step=2)
    assert zombie.fenced
    with pytest.raises(Fenced):
        commit(zombie, b"again", step=3)
    assert [i.manifest.step for i in store.snapshots(KEY)] == [1]
    retry_manifest = commit(retry, b"retry" * 1000, step=2)
    assert store.latest_good(KEY).seq == retry_manifest.seq
    assert store.restore(KEY, _tmp(store) ).manifest.epoch == retry.epoch


def test_done_then_zombie_commit_then_new_attempt_starts_fresh(store: Store) -> None:
    zombie = store.open_attempt(KEY)
    commit(zombie, b"z" * 5000, step=1)
    winner = store.open_attempt(KEY)
    commit(winner, b"w" * 5000, step=2)
    winner.finish()
    with pytest.raises(Fenced):
        commit(zombie, b"z2" * 5000, step=9)
    kinds = [r.kind for r in store.history(KEY)]
    assert kinds[-1] is RecordKind.DONE
    fresh = store.open_attempt(KEY)
    assert fresh.parent is None
    assert store.snapshots(KEY) == []


def test_concurrent_opens_get_distinct_epochs(store: Store) -> None:
    a = store.open_attempt(KEY)
    b = store.open_attempt(KEY)
    c = store.open_attempt(KEY)
    assert len({a.epoch, b.epoch, c.epoch}) == 3
    # Only the newest may write; the others are fenced at their first commit.
    for old in (a, b):
        with pytest.raises(Fenced):
            commit(old, b"x", step=1)
    commit(c, b"x", step=1)


def test_finish_by_a_zombie_is_fenced(store: Store) -> None:
    zombie = store.open_attempt(KEY)
    live = store.open_attempt(KEY)
    commit(live, b"live", step=1)
    with pytest.raises(Fenced):
        zombie.finish()
    assert store.latest_good(KEY).step == 1


_counter = iter(range(10**6))


def _tmp(store: Store) -> str:
    import tempfile

    return f"{tempfile.mkdtemp()}/restore-{next(_counter)}"


def test_resumed_attempt_adopts_its_own_records_and_sees_fencing(store: Store) -> None:
    first = store.open_attempt(KEY)
    m1 = commit(first, b"a" * 1000, step=1)
    m2 = commit(first, b"b" * 1000, step=2)  # committed by a process that then died silently
    taken_over = store.resume_attempt(KEY, epoch=first.epoch, last_seq=m1.seq, parent_seq=m1.seq)
    assert taken_over.log.last_seq == m2.seq and not taken_over.fenced
    assert taken_over.parent.seq == m2.seq
    assert commit(taken_over, b"c" * 1000, step=3).seq == m2.seq + 1
    store.open_attempt(KEY)  # a retry
    late = store.resume_attempt(KEY, epoch=first.epoch, last_seq=m2.seq + 1, parent_seq=None)
    assert late.fenced
    with pytest.raises(Fenced):
        commit(late, b"d", step=4)
