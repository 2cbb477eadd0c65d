"""Whether, and from which snapshot, the next try of a step resumes.

An orchestrator retries a step for two kinds of reasons: the capacity went away (a preemption,
a kill from outside) or the step failed on its own (an exception, an exit code). Resuming is
right after the first; after the second it may replay the very state that failed, forever.
:func:`plan_resume` reads the step's history (its tries in the slot log and their outcome
records, since the key was last marked done) and says which snapshots the next try must not
restore, and whether it should run at all:

* ``resume_on=ResumeOn.PREEMPTION``: after a try that failed with the step's own error, the
  next one starts fresh (every snapshot committed up to that try is excluded);
  ``ResumeOn.ANY_FAILURE`` (the default) resumes after errors too;
* ``max_error_retries``: once the step has failed with its own error more than this many times,
  stop (a crash loop); preemptions never count;
* the loop guard: when two tries resumed from the same snapshot and neither committed a newer
  one nor was ended by the capacity (a preemption, an eviction, a fence), that snapshot is
  excluded: the next try falls back to the one before it, then to a fresh start;
* ``max_preemptions``: :func:`after_try` says to reschedule a preempted try (its final snapshot
  committed) without consuming one of the orchestrator's retries, this many times at most.

Pure: no I/O, no clock; ``History.from_store`` reads what it needs. Stdlib only.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from cairn.exceptions import ConfigError
from cairn.policy.history import History
from cairn.runtime.env import format_seqs, parse_seqs
from cairn.store.outcomes import Outcome, OutcomeKind, SnapPoint, TryLog


# Tries ended by something other than the step: they say nothing about a bad snapshot.
# A suspension is neither a failure nor a preemption: it counts toward no limit.
_NOT_THE_STEPS_DOING = frozenset({OutcomeKind.PREEMPTED, OutcomeKind.EVICTED,
                                  OutcomeKind.FENCED, OutcomeKind.SUCCEEDED,
                                  OutcomeKind.SUSPENDED})


__all__ = ["AfterTry", "ResumeOn", "ResumePlan", "ResumePolicy", "after_try", "format_seqs",
           "parse_seqs", "plan_resume", "since_done"]


class ResumeOn(str, enum.Enum):
    """Which ends of the previous try the next one resumes after."""

    ANY_FAILURE = "any_failure"  # preemptions, kills from outside and the step's own errors
    PREEMPTION = "preemption"    # not after the step's own error: that try's successor starts fresh


class AfterTry(str, enum.Enum):
    """What the orchestrator should do once a try has ended."""

    RETRY = "retry"            # fail the try; the orchestrator's retries decide
    STOP = "stop"              # fail the task without further retries (a crash loop)
    RESCHEDULE = "reschedule"  # run again without consuming a retry (a preemption)


@dataclass(frozen=True)
class ResumePolicy:
    """See the module docstring. ``max_error_retries=None``: the orchestrator's retries only;
    ``max_preemptions=0``: every preemption consumes a retry."""

    resume_on: ResumeOn = ResumeOn.ANY_FAILURE
    max_error_retries: int | None = None
    loop_guard: bool = True
    max_preemptions: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "resume_on", ResumeOn(self.resume_on))
        except ValueError:
            choices = ", ".join(repr(r.value) for r in ResumeOn)
            raise ConfigError(f"resume_on must be one of {choices}, got {self.resume_on!r}") from None
        for name in ("max_error_retries", "max_preemptions"):
            value = getattr(self, name)
            if value is None and name == "max_error_retries":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class ResumePlan:
    """The verdict for the next try. ``exclude``: seqs it must not restore; ``resume_from``:
    the newest snapshot the log lists outside ``exclude`` (a restore still verifies it and may
    fall back further); ``give_up``: do not run; ``errors``/``preemptions``: tries so far
    that failed on their own / were ended by the capacity; ``reason``: one line."""

    exclude: frozenset[int]
    resume_from: SnapPoint | None
    give_up: bool
    errors: int
    preemptions: int
    reason: str


def since_done(history: History) -> tuple[list[TryLog], dict[int, Outcome]]:
    """The tries after the last one that marked the key done, and their outcomes by epoch."""
    tries = list(history.tries)
    for i in range(len(tries) - 1, -1, -1):
        if tries[i].done_at is not None:
            tries = tries[i + 1:]
            break
    epochs = {t.epoch for t in tries}
    return tries, {o.epoch: o for o in history.outcomes if o.epoch in epochs}


def plan_resume(history: History, policy: ResumePolicy = ResumePolicy()) -> ResumePlan:
    """Which snapshots the next try may restore, and whether it should run; see the module."""
    tries, outcomes = since_done(history)
    errors = sum(o.outcome is OutcomeKind.FAILED for o in outcomes.values())
    preemptions = sum(o.outcome.interrupted for o in outcomes.values())
    exclude: set[int] = set()
    why: list[str] = []
    stuck_on: Counter[int] = Counter()
    for index, attempt in enumerate(tries):
        outcome = outcomes.get(attempt.epoch)
        kind = outcome.outcome if outcome is not None else None
        if policy.resume_on is ResumeOn.PREEMPTION and kind is OutcomeKind.FAILED:
            exclude.update(s.seq for t in tries[:index + 1] for s in t.snapshots)
            why.append(f"try {attempt.epoch} failed on its own and resume_on=preemption: "
                       "its snapshots and older ones are not restored")
        if (policy.loop_guard and attempt.resumed_from is not None and not attempt.snapshots
                and kind not in _NOT_THE_STEPS_DOING):
            stuck_on[attempt.resumed_from] += 1
            if stuck_on[attempt.resumed_from] == 2 and attempt.resumed_from not in exclude:
                exclude.add(attempt.resumed_from)
                why.append(f"loop guard: two tries resumed from seq {attempt.resumed_from} "
                           "and committed nothing newer; falling back past it")
    available = sorted((s for t in tries for s in t.snapshots if s.seq not in exclude),
                       key=lambda s: s.seq, reverse=True)
    resume_from = available[0] if available else None
    give_up = policy.max_error_retries is not None and errors > policy.max_error_retries
    if give_up:
        why.append(f"the step failed with its own error {errors} times, more than "
                   f"max_error_retries={policy.max_error_retries}: not running it again")
    elif resume_from is not None:
        step = "" if resume_from.step is None else f" (step {resume_from.step})"
        why.append(f"resuming from seq {resume_from.seq}{step}")
    else:
        why.append("starting fresh" + (": every snapshot is excluded" if exclude else
                                       ": no snapshot to resume from"))
    return ResumePlan(exclude=frozenset(exclude), resume_from=resume_from, give_up=give_up,
                      errors=errors, preemptions=preemptions, reason="; ".join(why))


def after_try(plan: ResumePlan, policy: ResumePolicy, ended: OutcomeKind) -> AfterTry:
    """What to do once the try that ``plan`` started has ended as ``ended``: stop when its
    error goes past ``max_error_retries``; reschedule a preemption while fewer than
    ``max_preemptions`` have been rescheduled (``plan`` counted the earlier ones)."""
    if ended is OutcomeKind.FAILED and policy.max_error_retries is not None \
            and plan.errors + 1 > policy.max_error_retries:
        return AfterTry.STOP
    if ended.interrupted and plan.preemptions + 1 <= policy.max_preemptions:
        return AfterTry.RESCHEDULE
    return AfterTry.RETRY
