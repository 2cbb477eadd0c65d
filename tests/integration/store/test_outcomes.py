"""Outcome records on every backend: create-only per try, read back in epoch order, unreadable
ones skipped with a warning; and the per-try history derived from the slot log."""

from __future__ import annotations

import json
import logging

import pytest

from cairn.exceptions import AlreadyExists, ConfigError
from cairn.store import Key, Store
from cairn.store.outcomes import Outcome, OutcomeKind, Progress, outcome_name

KEY = Key(("dag", "train", "run-1", "0"))
T = 1_800_000_000.0


def preempted(epoch: int, **kw) -> Outcome:  # noqa: ANN003
    return Outcome(epoch=epoch, outcome=OutcomeKind.PREEMPTED, started_at=T + epoch * 1000,
                   ended_at=T + epoch * 1000 + 600, option="a100-spot",
                   reason="a100-spot: spot, cheapest", **kw)


def test_outcomes_round_trip_in_epoch_order(store: Store) -> None:
    second = Outcome(epoch=7, outcome=OutcomeKind.SUCCEEDED, started_at=T + 5000.25,
                     ended_at=T + 9000.5,
                     progress=Progress(start_step=400, end_step=1000, kept_step=1000,
                                       total_steps=1000, snapshot_seq=9),
                     snapshot_cost_s=12.5, restore_cost_s=20.0, frozen_s=0.42,
                     gpu_stall_s=1.25, option="a100-ondemand",
                     reason="a100-ondemand: 3 preemptions >= K=3: off spot",
                     detail={"pod": "train-abc", "estimates": {"a100-spot": {"mtbf_h": 1.5}}})
    store.records.record_outcome(KEY, second)
    store.records.record_outcome(KEY, preempted(2, progress=Progress(start_step=0, end_step=450,
                                                             kept_step=400)))
    got = store.records.outcomes(KEY)
    assert [o.epoch for o in got] == [2, 7]
    assert got[1] == second
    assert got[0].outcome is OutcomeKind.PREEMPTED and got[0].progress.kept_step == 400
    assert store.records.outcomes(Key(("other",))) == []


def test_a_second_outcome_for_the_same_try_is_refused_and_the_first_kept(store: Store) -> None:
    store.records.record_outcome(KEY, preempted(3))
    with pytest.raises(AlreadyExists, match="try 3 already has an outcome"):
        store.records.record_outcome(KEY, Outcome(epoch=3, outcome="succeeded", started_at=T,
                                          ended_at=T + 1))
    assert [o.outcome for o in store.records.outcomes(KEY)] == [OutcomeKind.PREEMPTED]


def test_corrupt_and_unknown_schema_records_are_skipped_with_a_warning(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    store.records.record_outcome(KEY, preempted(1))
    store.backend.create(outcome_name(KEY.path, 2), b"{not json")
    future = json.loads(store.backend.read(outcome_name(KEY.path, 1)))
    future.update(schema="cairn.outcome/9", epoch=3)
    store.backend.create(outcome_name(KEY.path, 3), json.dumps(future).encode())
    moved = dict(future, schema="cairn.outcome/1", epoch=5)  # stored at 4, claims 5
    store.backend.create(outcome_name(KEY.path, 4), json.dumps(moved).encode())
    bad_kind = dict(future, schema="cairn.outcome/1", epoch=6, outcome="vanished")
    store.backend.create(outcome_name(KEY.path, 6), json.dumps(bad_kind).encode())
    with caplog.at_level(logging.WARNING, logger="cairn.store.store"):
        got = store.records.outcomes(KEY)
    assert [o.epoch for o in got] == [1]
    text = caplog.text
    assert "cairn.outcome/9" in text and "upgrade cairn" in text
    assert "says epoch 5 but is stored at 4" in text
    assert text.count("skipping outcome record") == 4


def test_tries_come_from_the_slot_log(store: Store) -> None:
    first = store.open_attempt(KEY)
    with first.snapshot() as snap:
        snap.add_bytes("state.bin", b"a" * 1000)
        snap.commit(step=100)
    second = store.open_attempt(KEY)
    assert second.parent is not None
    with second.snapshot() as snap:
        snap.add_bytes("state.bin", b"b" * 1000)
        snap.commit(step=250)
    second.finish()  # deletes the snapshots: their records leave the history
    tries = store.records.tries(KEY)
    assert [t.epoch for t in tries] == [first.epoch, second.epoch]
    assert tries[0].resumed_from is None and tries[1].resumed_from == first.epoch + 1
    assert tries[0].opened_at <= tries[1].opened_at
    assert tries[0].done_at is None and tries[1].done_at is not None
    assert all(t.snapshots == () for t in tries)


def test_tries_list_the_snapshots_retention_kept(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    for step in (10, 20):
        with attempt.snapshot() as snap:
            snap.add_bytes("state.bin", bytes([step]) * 1000)
            snap.commit(step=step)
    (only,) = store.records.tries(KEY)
    assert [s.step for s in only.snapshots] == [10, 20]
    assert only.snapshots[0].at <= only.snapshots[1].at


@pytest.mark.parametrize("bad, match", [
    (dict(epoch=0), "epoch"),
    (dict(outcome="exploded"), "unknown outcome"),
    (dict(ended_at=T - 1), "before started_at"),
    (dict(snapshot_cost_s=-1.0), "snapshot_cost_s"),
    (dict(reason="two\nlines"), "one line"),
    (dict(detail={"x": object()}), "plain JSON"),
    (dict(started_at=float("nan")), "finite"),
])
def test_bad_outcomes_are_refused_with_the_fix(bad: dict, match: str) -> None:
    fields = dict(epoch=1, outcome="preempted", started_at=T, ended_at=T + 10)
    fields.update(bad)
    with pytest.raises(ConfigError, match=match):
        Outcome(**fields)
    with pytest.raises(ConfigError, match="non-negative integer"):
        Progress(kept_step=-3)
