"""Each try's summary survives retention and ``done`` (docs/adr/0031): the try's own in its
outcome record, else what the next try's ``open`` noted about it, else the slot log; on every
backend, plain and sealed."""

from __future__ import annotations

import json
import logging
import time

import pytest

from cairn.runtime import endings
from cairn.store import Key, Store
from cairn.store.outcomes import (
    Outcome,
    OutcomeKind,
    TrySummary,
    outcome_name,
    try_summaries,
)

KEY = Key(("dag", "train", "run-1", "0"))


def commit(attempt, step: int, size: int = 1000) -> int:  # noqa: ANN001 - a cairn Attempt
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", bytes([step % 256]) * size)
        return snap.commit(step=step).seq


def test_a_killed_try_keeps_its_history_through_retention_and_done(store: Store) -> None:
    """Try 1 commits five snapshots (retention keeps three) and is killed without an outcome;
    try 2 resumes, commits two, records its outcome and marks the key done."""
    first = store.open_attempt(KEY, note={"mode": "state"})
    seqs = [commit(first, step) for step in (1, 3, 5, 7, 9)]
    assert len(store.snapshots(KEY)) == 3  # retention pruned the first two already
    second = store.open_attempt(KEY, note={"mode": "state"})
    assert second.parent is not None and second.parent.seq == seqs[-1]
    commit(second, 11, size=3000)
    commit(second, 13, size=3000)
    started = time.time()
    assert endings.record_best_effort(store, KEY, Outcome(
        epoch=second.epoch, outcome=OutcomeKind.SUCCEEDED, started_at=started,
        ended_at=started))
    second.finish()
    assert store.snapshots(KEY) == []  # done: every snapshot record is gone

    got = store.records.try_summaries(KEY)
    killed, done = got[first.epoch], got[second.epoch]
    assert (killed.snapshots, killed.last_step, killed.last_seq) == (5, 9, seqs[-1])
    assert killed.bytes_logical == 1000
    # Only the three snapshots retention had kept when try 2 opened are measured, and it says so.
    assert killed.complete is False and killed.bytes_written == 3 * 1000
    assert (done.snapshots, done.last_step) == (2, 13)
    assert done.complete and done.bytes_written == 2 * 3000
    # The summaries are in the records, not computed from what is gone.
    opened = store.log(KEY).read(second.epoch)
    assert opened.body["note"]["previous"]["epoch"] == first.epoch
    assert store.records.outcomes(KEY)[0].summary == done


def test_the_count_comes_from_the_seqs_even_without_any_note(store: Store) -> None:
    """An old store: no ``previous`` note, no summaries in outcome records. The count is still
    exact (every seq up to the next ``open`` was the try's), and the last step is the one the
    next try resumed from."""
    first = store.open_attempt(KEY, note={"mode": "state", "previous": None})
    for step in (2, 4, 6, 8):
        commit(first, step)
    second = store.open_attempt(KEY, note={"mode": "state", "previous": None})
    second.finish()
    got = store.records.try_summaries(KEY)
    assert got[first.epoch].snapshots == 4
    assert got[first.epoch].last_step == 8 and got[first.epoch].complete is False
    assert got[first.epoch].bytes_written is None  # not known: nothing is left to count
    assert got[second.epoch].snapshots == 0 and got[second.epoch].complete


def test_a_try_that_still_holds_its_snapshots_is_summarized_from_the_log(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    commit(attempt, 10)
    time.sleep(0.02)
    commit(attempt, 20)
    (only,) = store.records.try_summaries(KEY).values()
    assert (only.snapshots, only.last_step, only.complete) == (2, 20, True)
    assert only.seconds_per_step is not None and only.seconds_per_step > 0
    assert only.stall_s is None  # stalls are measured by the try, not kept in the log


def test_an_outcome_record_without_a_summary_still_reads(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    commit(attempt, 5)
    old = Outcome(epoch=attempt.epoch, outcome=OutcomeKind.PREEMPTED, started_at=1.0,
                  ended_at=2.0).to_json()
    del old["summary"], old["options"]  # as cairn wrote them before these fields
    store.backend.create(outcome_name(KEY.path, attempt.epoch), json.dumps(old).encode())
    (outcome,) = store.records.outcomes(KEY)
    assert outcome.summary is None and outcome.options == ()
    assert store.records.try_summaries(KEY)[attempt.epoch].last_step == 5


def test_an_unreadable_summary_drops_only_the_summary(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    attempt = store.open_attempt(KEY)
    doc = Outcome(epoch=attempt.epoch, outcome=OutcomeKind.PREEMPTED, started_at=1.0,
                  ended_at=2.0).to_json()
    doc["summary"] = {"snapshots": -3}
    store.backend.create(outcome_name(KEY.path, attempt.epoch), json.dumps(doc).encode())
    with caplog.at_level(logging.WARNING):
        (outcome,) = store.records.outcomes(KEY)
    assert outcome.outcome is OutcomeKind.PREEMPTED and outcome.summary is None
    assert "unreadable summary" in caplog.text


def test_a_malformed_note_falls_back_to_the_log(local_store: Store,
                                               caplog: pytest.LogCaptureFixture) -> None:
    store = local_store
    first = store.open_attempt(KEY)
    for step in (1, 3, 5, 7):
        commit(first, step)
    store.log(KEY).open_attempt(note={"previous": {"epoch": first.epoch, "snapshots": "x"},
                                      "resumed_from": first.epoch + 4, "resumed_step": 7})
    with caplog.at_level(logging.WARNING):
        got = try_summaries(store.history(KEY))[first.epoch]
    assert "unreadable" in caplog.text
    # The log's three retained snapshots, the exact count from the seqs.
    assert got == TrySummary(snapshots=4, last_step=7, last_seq=first.epoch + 4,
                             bytes_logical=1000, bytes_written=3000, complete=False,
                             seconds_per_step=got.seconds_per_step)


@pytest.fixture()
def local_store(tmp_path):  # noqa: ANN201
    from cairn import open_store

    with open_store(str(tmp_path / "store")) as opened:
        yield opened
