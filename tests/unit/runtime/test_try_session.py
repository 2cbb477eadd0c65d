"""The try session's state machine: its phases, its interval, its watchers and the final
snapshot's decision, driven as a mode drives it (the modes' own tests drive it for real)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.exceptions import Fenced
from cairn.runtime import channel
from cairn.runtime.channel import Cause
from cairn.runtime.exits import ExitCode
from cairn.runtime.session import Ending, TryEnd
from cairn.runtime.try_session import (
    CauseWatch,
    Cost,
    FinalVerdict,
    Phase,
    PhaseError,
    Saved,
    TrySession,
)
from cairn.store.outcomes import OutcomeKind


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RecordingSnapshotter:
    """A mode's side of the session, recording how the session called it."""

    def __init__(self, *, cost: Cost | None = None, blocked: str | None = None,
                 saved: Saved | None = Saved(seq=4), fenced: bool = False) -> None:
        self._cost, self._blocked, self._saved, self._fenced = cost, blocked, saved, fenced
        self.calls: list[tuple[bool, float | None]] = []

    def cost(self) -> Cost | None:
        return self._cost

    def blocked(self) -> str | None:
        return self._blocked

    def snapshot(self, *, final: bool, timeout_s: float | None) -> Saved | None:
        self.calls.append((final, timeout_s))
        if self._fenced:
            raise Fenced("epoch 1 is fenced")
        return self._saved

    def stopped(self) -> bool:
        return self._saved is not None


def running(clock: Clock, **options: object) -> TrySession:
    session = TrySession(clock=clock, **options)  # type: ignore[arg-type]
    session.opened(3)
    session.started(restored_from=None)
    return session


def test_a_try_goes_through_its_phases_in_order_and_ends_once() -> None:
    session = TrySession()
    assert session.phase is Phase.OPENING
    with pytest.raises(PhaseError, match="from opening to running"):
        session.started(restored_from=None)
    session.opened(7)
    session.started(restored_from=5)
    assert (session.phase, session.epoch, session.restored_from) == (Phase.RUNNING, 7, 5)
    conclusion = session.end(TryEnd(ending=Ending.SUCCEEDED))
    assert (conclusion.exit_code, conclusion.outcome) == (ExitCode.OK, OutcomeKind.SUCCEEDED)
    with pytest.raises(PhaseError, match="from ended to ended"):
        session.end(TryEnd(ending=Ending.FAILED))


def test_a_try_that_never_started_still_concludes() -> None:
    session = TrySession()
    session.opened(1)
    conclusion = session.end(TryEnd(ending=Ending.RESTORE_FAILED))
    assert conclusion.exit_code == ExitCode.RESTORE_FAILED


def test_periodic_snapshots_fall_due_a_whole_interval_after_the_last() -> None:
    clock = Clock()
    session = running(clock, every_s=10.0)
    assert not session.due() and session.seconds_to_due() == 10.0
    clock.now += 10.0
    assert session.due()
    session.defer(1.0)  # busy: look again in a second, not a whole interval
    assert not session.due()
    clock.now += 1.0
    assert session.due()
    session.snapshot_taken()
    clock.now += 9.9
    assert not session.due()
    assert session.due(every_s=5.0)  # an adaptive interval is the mode's to pass


def test_no_interval_means_never_due() -> None:
    clock = Clock()
    session = running(clock)
    clock.now += 1e6
    assert not session.due() and session.seconds_to_due() is None


def test_a_notice_is_looked_at_before_the_suspend_request() -> None:
    polled: list[str] = []
    session = running(Clock(), notice=lambda: polled.append("notice") or True,
                      suspend=lambda: polled.append("suspend") or True)
    assert session.triggers().notice and polled == ["notice"]
    session = running(Clock(), notice=lambda: False)
    session.set_watchers(suspend=lambda: object())
    assert session.triggers().suspend


def test_a_final_snapshot_that_fits_is_taken_with_the_budget_as_its_timeout() -> None:
    session = running(Clock())
    snapshotter = RecordingSnapshotter(cost=Cost(2.0, "the last snapshot took"))
    final = session.final_snapshot(snapshotter, remaining_s=5.0)
    assert final.verdict is FinalVerdict.SAVED and final.saved == Saved(seq=4)
    assert snapshotter.calls == [(True, 5.0)] and session.phase is Phase.ENDING
    assert session.end(TryEnd(ending=Ending.PREEMPTED, saved=True)).exit_code == \
        ExitCode.PREEMPTED_SAVED


def test_a_final_snapshot_over_budget_or_blocked_is_not_tried() -> None:
    over = RecordingSnapshotter(cost=Cost(9.0, "the last snapshot took"))
    final = running(Clock()).final_snapshot(over, remaining_s=5.0)
    assert final.verdict is FinalVerdict.OVER_BUDGET and final.cost == over.cost()
    blocked = RecordingSnapshotter(blocked="a lazy restore is filling memory")
    final = running(Clock()).final_snapshot(blocked, remaining_s=5.0)
    assert final.verdict is FinalVerdict.BLOCKED and final.blocked == blocked.blocked()
    assert over.calls == blocked.calls == []


def test_a_suspend_has_no_deadline_and_may_carry_on_after_a_failure() -> None:
    session = running(Clock())
    failing = RecordingSnapshotter(cost=Cost(1e9, "huge"), saved=None)
    final = session.final_snapshot(failing, remaining_s=None, timeout_s=30.0)
    assert final.verdict is FinalVerdict.FAILED and failing.calls == [(True, 30.0)]
    session.carry_on()
    assert session.phase is Phase.RUNNING


def test_a_fence_during_the_final_snapshot_propagates() -> None:
    session = running(Clock())
    with pytest.raises(Fenced):
        session.final_snapshot(RecordingSnapshotter(fenced=True), remaining_s=5.0)
    assert session.end(TryEnd(ending=Ending.FENCED)).exit_code == ExitCode.FENCED


def test_a_suspended_jobs_preemption_ends_suspended(tmp_path: Path) -> None:
    """The cause watch asks through the channel's files, answered here as the sidecar answers
    (:func:`cairn.runtime.channel.write_cause`); a suspended Job turns a preemption into a
    suspension (a Kueue eviction)."""
    directory = str(tmp_path)
    channel.write_cause(directory, Cause(suspended=False, reason="can answer"))
    session = running(Clock(), cause=CauseWatch.beside(str(tmp_path / "notice.json")))
    assert session.cause.ask(signal_name="SIGTERM")
    assert channel.read_ask(directory) == session.cause.asked_at
    channel.write_cause(directory, Cause(suspended=True, reason="the Job was suspended",
                                         asked_at=session.cause.asked_at))
    end = session.after_cause(TryEnd(ending=Ending.PREEMPTED, saved=True), budget_left_s=10.0)
    assert end.ending is Ending.SUSPENDED and end.saved
    assert session.end(end).outcome is OutcomeKind.SUSPENDED


def test_without_a_sidecar_nothing_is_asked_and_a_preemption_stays_one() -> None:
    session = running(Clock())
    assert not session.cause.ask(signal_name="SIGTERM")
    end = TryEnd(ending=Ending.PREEMPTED)
    assert session.after_cause(end, budget_left_s=10.0) == end
