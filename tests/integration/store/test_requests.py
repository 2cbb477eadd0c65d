"""Suspend and resume requests on every backend: create-only beside the slot log, one per
target epoch; they never take a seq or fence the running try; bad asks change nothing."""

from __future__ import annotations

import logging

import pytest

from cairn.exceptions import ConfigError, NotFound
from cairn.store import Key, Store
from cairn.store.outcomes import Outcome, OutcomeKind
from cairn.store.requests import RequestKind, SuspendState, request_name, requests_prefix
from cairn.store.slotlog import RecordKind

KEY = Key(("dag", "train", "run-1", "0"))
T = 1_800_000_000.0


def _names(store: Store) -> list[str]:
    return [info.name for info in store.backend.list(requests_prefix(KEY.path))]


def test_a_suspend_targets_the_running_try_and_asking_again_changes_nothing(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    seqs = store.log(KEY).seqs()
    ask = store.records.request_suspend(KEY, by="ops@example", reason="urgent job needs the GPUs")
    assert (ask.kind, ask.epoch, ask.by, ask.reason) == (
        RequestKind.SUSPEND, attempt.epoch, "ops@example", "urgent job needs the GPUs")
    assert store.records.request_suspend(KEY, by="someone-else") == ask
    assert _names(store) == [request_name(KEY.path, RequestKind.SUSPEND, attempt.epoch)]
    assert store.log(KEY).seqs() == seqs, "a request takes no seq"
    assert store.records.pending_suspend(KEY, epoch=attempt.epoch) == ask
    assert store.records.pending_suspend(KEY, epoch=attempt.epoch + 1) is None
    held = store.records.suspension(KEY)
    assert held is not None and held.state is SuspendState.REQUESTED and held.held

    # The running try is not fenced: it commits its final snapshot and records its outcome.
    with attempt.snapshot() as snap:
        snap.add_bytes("state.bin", b"x" * 1000)
        final = snap.commit(step=41)
    store.records.record_outcome(KEY, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.SUSPENDED,
                                      started_at=T, ended_at=T + 60))
    assert store.manifest(KEY).seq == final.seq
    held = store.records.suspension(KEY)
    assert held is not None and held.state is SuspendState.SUSPENDED
    assert held.outcome is OutcomeKind.SUSPENDED
    assert store.records.request_suspend(KEY) == ask, "suspending a suspended key is idempotent"


def test_resume_lifts_the_suspension_once_and_the_next_try_clears_it(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    with pytest.raises(ConfigError, match="not suspended"):
        store.records.request_resume(KEY)
    assert _names(store) == []
    store.records.request_suspend(KEY)
    resume = store.records.request_resume(KEY, by="ops@example")
    assert store.records.request_resume(KEY) == resume, "a second resume changes nothing"
    assert store.records.pending_suspend(KEY, epoch=attempt.epoch) is None, "resumed: not to honour"
    held = store.records.suspension(KEY)
    assert held is not None and held.state is SuspendState.RESUMING and not held.held
    assert [r.kind for r in store.records.requests(KEY)] == [RequestKind.SUSPEND, RequestKind.RESUME]
    store.open_attempt(KEY)
    assert store.records.suspension(KEY) is None
    with pytest.raises(ConfigError, match="not suspended"):
        store.records.request_resume(KEY)


def _suspended(store: Store, key: Key, *, options: tuple[str, ...] = ()) -> int:
    """A try of ``key`` asked to suspend, which honoured it recording ``options``."""
    attempt = store.open_attempt(key)
    store.records.request_suspend(key)
    store.records.record_outcome(key, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.SUSPENDED,
                                      started_at=T, ended_at=T + 1, options=options))
    return attempt.epoch


def test_resume_on_another_placement_is_refused_with_why(store: Store) -> None:
    store.open_attempt(KEY)
    store.records.request_suspend(KEY)
    with pytest.raises(ConfigError, match="has not stopped"):
        store.records.request_resume(KEY, placement="a100-ondemand")
    # A step on an Airflow worker records no capacity options: it cannot be moved at all.
    worker = Key(("dag", "on-a-worker", "run-1", "0"))
    _suspended(store, worker)
    with pytest.raises(ConfigError, match="Airflow has no call that changes a task instance's "
                                          "queue or pool"):
        store.records.request_resume(worker, placement="a100-ondemand")
    pod = Key(("dag", "in-a-pod", "run-1", "0"))
    _suspended(store, pod, options=("a100-spot", "a100-ondemand"))
    with pytest.raises(ConfigError, match=r"not one of the step's capacity options "
                                          r"\(a100-spot, a100-ondemand\)"):
        store.records.request_resume(pod, placement="h100")
    for key in (KEY, worker, pod):
        assert [r.kind for r in store.records.requests(key)] == [RequestKind.SUSPEND]


def test_a_pod_step_resumes_on_one_of_its_options(store: Store) -> None:
    epoch = _suspended(store, KEY, options=("a100-spot", "a100-ondemand"))
    asked = store.records.request_resume(KEY, by="ops@example", placement="a100-ondemand")
    assert (asked.epoch, asked.placement) == (epoch, "a100-ondemand")
    held = store.records.suspension(KEY)
    assert held is not None and held.state is SuspendState.RESUMING
    assert held.to_json()["placement"] == "a100-ondemand"
    # A second resume changes nothing, whatever it names.
    assert store.records.request_resume(KEY, placement="a100-spot") == asked


def test_suspending_an_unknown_done_or_ended_key_is_refused_and_writes_nothing(
        store: Store) -> None:
    with pytest.raises(NotFound, match="unknown"):
        store.records.request_suspend(KEY)
    attempt = store.open_attempt(KEY)
    store.records.record_outcome(KEY, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.PREEMPTED,
                                      started_at=T, ended_at=T + 1))
    with pytest.raises(ConfigError, match="not running.*ended preempted"):
        store.records.request_suspend(KEY)
    store.open_attempt(KEY).finish()
    assert store.log(KEY).records()[-1].kind is RecordKind.DONE
    with pytest.raises(ConfigError, match="is done"):
        store.records.request_suspend(KEY)
    assert _names(store) == []


def test_unreadable_requests_are_skipped_with_a_warning(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    attempt = store.open_attempt(KEY)
    store.backend.create(request_name(KEY.path, RequestKind.SUSPEND, attempt.epoch), b"{not json")
    store.backend.create(request_name(KEY.path, RequestKind.RESUME, 7),
                         b'{"schema": "cairn.request/9"}')
    with caplog.at_level(logging.WARNING, logger="cairn.store.store"):
        assert store.records.requests(KEY) == []
        assert store.records.pending_suspend(KEY, epoch=attempt.epoch) is None
    assert "cairn.request/9" in caplog.text and "upgrade cairn" in caplog.text
    assert caplog.text.count("skipping request record") == 3
