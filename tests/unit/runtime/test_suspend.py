"""cairn.runtime.suspend: how often a running try reads the store, what a failed read does,
and how a try ends when a request is honoured or its key is held suspended."""

from __future__ import annotations

import logging

import pytest

from cairn.exceptions import ConfigError, StoreError, Suspended
from cairn.runtime import env
from cairn.runtime.exits import ExitCode
from cairn.runtime.session import Conclusion, conclude, end_of_error, end_of_exit
from cairn.runtime.suspend import SuspendWatch, held, honoured, poll_seconds
from cairn.store.outcomes import OutcomeKind
from cairn.store.requests import Request, RequestKind, Suspension, SuspendState

ASK = Request(kind=RequestKind.SUSPEND, epoch=3, by="ops@host", at=1_800_000_000.0,
              reason="urgent job")


class FakeStore:
    """Stands in for a Store's request reads (a FAKE: answers what the test sets)."""

    def __init__(self) -> None:
        self.answer: Request | None = None
        self.reads = 0
        self.fail = False
        self.held: Suspension | None = None

    @property
    def records(self) -> FakeStore:  # its records too
        return self

    def pending_suspend(self, key: object, *, epoch: int) -> Request | None:
        self.reads += 1
        if self.fail:
            raise StoreError("bucket unreachable")
        return self.answer

    def suspension(self, key: object) -> Suspension | None:
        return self.held


def test_the_store_is_read_at_most_once_per_interval_and_a_request_stays_seen() -> None:
    now = [100.0]
    store = FakeStore()
    watch = SuspendWatch(store, "k", epoch=3, interval_s=5.0, clock=lambda: now[0])
    assert watch.poll() is None and store.reads == 1
    now[0] += 4.9
    assert watch.poll() is None and store.reads == 1
    store.answer = ASK
    now[0] += 0.1
    assert watch.poll() == ASK and store.reads == 2
    store.answer = None
    now[0] += 60
    assert watch.poll() == ASK and store.reads == 2
    watch.again_later()
    assert watch.poll() is None and store.reads == 2
    now[0] += 5
    assert watch.poll() is None and store.reads == 3


def test_a_failing_read_counts_as_no_request_and_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    store = FakeStore()
    store.fail = True
    watch = SuspendWatch(store, "k", epoch=3, interval_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="cairn.runtime.suspend"):
        for _ in range(3):
            assert watch.poll() is None
            now[0] += 1
    assert caplog.text.count("cannot look for a suspend request") == 1
    store.fail, store.answer = False, ASK
    assert watch.poll() == ASK


def test_the_interval_comes_from_the_option_or_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.SUSPEND_POLL.name, raising=False)
    assert poll_seconds() == 5.0
    monkeypatch.setenv(env.SUSPEND_POLL.name, "250ms")
    assert poll_seconds() == 0.25
    assert poll_seconds(2) == 2.0
    with pytest.raises(ConfigError, match="suspend_poll_seconds"):
        poll_seconds("soon")
    with pytest.raises(ConfigError, match="positive"):
        SuspendWatch(FakeStore(), "k", epoch=1, interval_s=0)


def test_an_honoured_request_ends_the_try_suspended_with_its_code() -> None:
    error = honoured(ASK, seq=9, what="step 41")
    assert isinstance(error, Suspended) and error.code == ExitCode.SUSPENDED and error.seq == 9
    assert "ops@host" in str(error) and "urgent job" in str(error) and "step 41" in str(error)
    assert conclude(end_of_error(error)) == Conclusion(ExitCode.SUSPENDED, OutcomeKind.SUSPENDED)
    assert conclude(end_of_exit(ExitCode.SUSPENDED)).outcome is OutcomeKind.SUSPENDED


def test_a_try_of_a_held_key_stops_before_it_starts() -> None:
    store = FakeStore()
    assert held(store, "d/t/r") is None
    store.held = Suspension(SuspendState.SUSPENDED, ASK)
    error = held(store, "d/t/r")
    assert error is not None and error.code == ExitCode.SUSPENDED and error.seq is None
    assert "cairn resume STORE d/t/r" in str(error)
    resume = Request(kind=RequestKind.RESUME, epoch=3, by="ops@host", at=1_800_000_100.0)
    store.held = Suspension(SuspendState.RESUMING, ASK, resume)
    assert held(store, "d/t/r") is None
