"""cairn.policy.resume: errors versus preemptions, the crash-loop stop and the loop guard."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.policy import History
from cairn.policy.resume import (
    AfterTry,
    ResumeOn,
    ResumePolicy,
    after_try,
    format_seqs,
    parse_seqs,
    plan_resume,
)
from cairn.store.outcomes import Outcome, OutcomeKind, SnapPoint, TryLog

T0 = 1_790_000_000.0


def attempt(epoch: int, *, snaps: tuple[int, ...] = (), resumed_from: int | None = None,
            done: bool = False) -> TryLog:
    return TryLog(epoch=epoch, opened_at=T0 + epoch,
                  snapshots=tuple(SnapPoint(seq, T0 + seq, seq * 10) for seq in snaps),
                  done_at=T0 + epoch + 0.5 if done else None, resumed_from=resumed_from)


def ended(epoch: int, kind: OutcomeKind) -> Outcome:
    return Outcome(epoch=epoch, outcome=kind, started_at=T0 + epoch, ended_at=T0 + epoch + 1)


F, P, S = OutcomeKind.FAILED, OutcomeKind.PREEMPTED, OutcomeKind.SUCCEEDED


def test_nothing_yet_starts_fresh() -> None:
    plan = plan_resume(History())
    assert plan.resume_from is None and not plan.exclude and not plan.give_up
    assert plan.reason == "starting fresh: no snapshot to resume from"


def test_after_a_preemption_the_newest_snapshot_is_resumed() -> None:
    plan = plan_resume(History((ended(1, P),), (attempt(1, snaps=(2, 3)),)))
    assert plan.resume_from is not None and plan.resume_from.seq == 3
    assert plan.preemptions == 1 and plan.errors == 0 and "resuming from seq 3" in plan.reason


def test_errors_resume_by_default_and_start_fresh_with_resume_on_preemption() -> None:
    history = History((ended(1, F),), (attempt(1, snaps=(2, 3)),))
    assert plan_resume(history).resume_from.seq == 3  # type: ignore[union-attr]
    plan = plan_resume(history, ResumePolicy(resume_on=ResumeOn.PREEMPTION))
    assert plan.resume_from is None and plan.exclude == {2, 3}
    assert "try 1 failed on its own" in plan.reason and "starting fresh" in plan.reason


def test_after_an_error_only_the_fresh_successors_snapshots_are_resumed() -> None:
    # try 1 failed; try 2 started fresh, committed seq 5 and was preempted.
    history = History((ended(1, F), ended(4, P)),
                      (attempt(1, snaps=(2, 3)), attempt(4, snaps=(5,))))
    plan = plan_resume(history, ResumePolicy(resume_on="preemption"))
    assert plan.resume_from is not None and plan.resume_from.seq == 5
    # ... and when the fresh try was preempted before its first snapshot, still fresh:
    history = History((ended(1, F), ended(4, P)), (attempt(1, snaps=(2, 3)), attempt(4)))
    assert plan_resume(history, ResumePolicy(resume_on="preemption")).resume_from is None


def test_max_error_retries_counts_only_the_steps_own_errors() -> None:
    tries = (attempt(1, snaps=(2,)), attempt(3, resumed_from=2, snaps=(4,)),
             attempt(5, resumed_from=4, snaps=(6,)))
    policy = ResumePolicy(max_error_retries=1)
    two_errors = History((ended(1, F), ended(3, P), ended(5, F)), tries)
    plan = plan_resume(two_errors, policy)
    assert plan.give_up and plan.errors == 2 and "max_error_retries=1" in plan.reason
    one_error = History((ended(1, P), ended(3, P), ended(5, F)), tries)
    assert not plan_resume(one_error, policy).give_up


def test_a_done_key_forgets_its_earlier_tries() -> None:
    tries = (attempt(1, snaps=(2,)), attempt(3, resumed_from=2, done=True), attempt(5))
    plan = plan_resume(History((ended(1, F), ended(3, S), ended(5, F)), tries),
                       ResumePolicy(max_error_retries=1))
    assert plan.errors == 1 and not plan.give_up and plan.resume_from is None


def test_the_loop_guard_falls_back_to_the_previous_snapshot_then_fresh() -> None:
    base = [attempt(1, snaps=(2, 3))]
    # Two tries resumed from seq 3 and died without committing (no record: killed outright).
    stuck_on_3 = base + [attempt(4, resumed_from=3), attempt(5, resumed_from=3)]
    plan = plan_resume(History((ended(1, P),), tuple(stuck_on_3)))
    assert plan.exclude == {3} and plan.resume_from.seq == 2  # type: ignore[union-attr]
    assert "loop guard: two tries resumed from seq 3" in plan.reason
    # One stuck try is not a loop.
    assert not plan_resume(History((ended(1, P),), tuple(stuck_on_3[:2]))).exclude
    # Then two more stuck on seq 2: nothing left, a fresh start.
    stuck_on_2 = stuck_on_3 + [attempt(6, resumed_from=2), attempt(7, resumed_from=2)]
    plan = plan_resume(History((ended(1, P),), tuple(stuck_on_2)))
    assert plan.exclude == {2, 3} and plan.resume_from is None
    assert "every snapshot is excluded" in plan.reason
    assert not plan_resume(History((ended(1, P),), tuple(stuck_on_2)),
                           ResumePolicy(loop_guard=False)).exclude


def test_the_loop_guard_ignores_tries_the_capacity_ended() -> None:
    tries = (attempt(1, snaps=(2, 3)), attempt(4, resumed_from=3), attempt(5, resumed_from=3))
    for kind in (OutcomeKind.PREEMPTED, OutcomeKind.EVICTED, OutcomeKind.FENCED):
        plan = plan_resume(History((ended(1, P), ended(4, kind), ended(5, kind)), tries))
        assert not plan.exclude, kind
    plan = plan_resume(History((ended(1, P), ended(4, F), ended(5, F)), tries))
    assert plan.exclude == {3}


def test_a_suspension_is_neither_an_error_nor_a_preemption() -> None:
    su = OutcomeKind.SUSPENDED
    tries = (attempt(1, snaps=(2, 3)), attempt(4, resumed_from=3), attempt(5, resumed_from=3))
    history = History((ended(1, su), ended(4, su), ended(5, su)), tries)
    plan = plan_resume(history, ResumePolicy(resume_on=ResumeOn.PREEMPTION))
    assert (plan.errors, plan.preemptions, plan.exclude) == (0, 0, frozenset())
    assert plan.resume_from is not None and plan.resume_from.seq == 3
    assert after_try(plan, ResumePolicy(max_error_retries=0, max_preemptions=5), su) \
        is AfterTry.RETRY
    with_option = History(tuple(Outcome(epoch=e, outcome=su, started_at=T0, ended_at=T0 + 9,
                                        option="a100-spot") for e in (1, 4)), tries)
    assert with_option.preemptions() == 0 and with_option.interruptions_on("a100-spot") == 0


def test_a_try_that_committed_something_newer_is_progress() -> None:
    tries = (attempt(1, snaps=(2, 3)), attempt(4, resumed_from=3, snaps=(6,)),
             attempt(7, resumed_from=3))
    assert not plan_resume(History((), tries)).exclude


def test_after_try_stops_a_crash_loop_and_reschedules_preemptions() -> None:
    history = History((ended(1, P), ended(3, F)), (attempt(1, snaps=(2,)), attempt(3)))
    policy = ResumePolicy(max_error_retries=1, max_preemptions=2)
    plan = plan_resume(history, policy)
    assert (plan.errors, plan.preemptions) == (1, 1)
    assert after_try(plan, policy, F) is AfterTry.STOP            # the second error
    assert after_try(plan, policy, P) is AfterTry.RESCHEDULE      # the second preemption
    assert after_try(plan, policy, OutcomeKind.EVICTED) is AfterTry.RESCHEDULE
    assert after_try(plan, ResumePolicy(max_preemptions=1), P) is AfterTry.RETRY
    assert after_try(plan, ResumePolicy(), F) is AfterTry.RETRY
    assert after_try(plan, policy, OutcomeKind.FENCED) is AfterTry.RETRY


@pytest.mark.parametrize("options, message", [
    ({"resume_on": "errors"}, "resume_on must be one of"),
    ({"max_error_retries": -1}, "max_error_retries must be a non-negative integer"),
    ({"max_preemptions": 1.5}, "max_preemptions must be a non-negative integer"),
    ({"max_preemptions": None}, "max_preemptions must be a non-negative integer"),
])
def test_bad_policies_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ResumePolicy(**options)


def test_seq_lists_round_trip_and_bad_ones_name_the_form() -> None:
    assert parse_seqs("12, 3,3") == {3, 12} and format_seqs({12, 3}) == "3,12"
    assert parse_seqs("") == frozenset()
    with pytest.raises(ConfigError, match="comma-separated snapshot seqs, e.g. 12,15"):
        parse_seqs("12;15", source="--exclude-seqs")
    with pytest.raises(ConfigError, match="positive"):
        parse_seqs("0")
