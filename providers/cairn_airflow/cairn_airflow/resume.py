"""The resume policy of cairn's operators, in Airflow's terms (see :mod:`cairn.policy.resume`).

Every cairn operator takes the same four options:

- ``resume_on``: ``"any_failure"`` (default; a retry resumes after errors too) or
  ``"preemption"`` (after the step's own error the retry starts fresh);
- ``max_error_retries``: once the step has failed with its own error more than this many
  times, the try fails with ``AirflowFailException`` and Airflow stops retrying, whatever
  ``retries`` says (preemptions never count);
- ``loop_guard``: two tries that resumed from the same snapshot and committed nothing newer
  make the next one fall back past it (then to a fresh start);
- ``max_preemptions``: a try preempted with its final snapshot committed (SIGTERM from a node
  shutdown or a spot reclaim reaching the task) raises ``AirflowRescheduleException``: the task
  goes ``up_for_reschedule`` and runs again after ``retry_delay`` (at least 15 s, see
  :data:`MIN_RESCHEDULE_DELAY`) **without consuming a retry**
  (Airflow keeps the try number), this many times per key; then preemptions are retried as
  usual. A try that is SIGKILLed never gets to say so and consumes a retry.

Each try's outcome record (written by the operator or ``cairn run``) is what the next try's
plan reads, so the verdict survives workers and schedulers.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from cairn.exceptions import ConfigError

if TYPE_CHECKING:  # cairn.policy is imported when used: plugins load this module everywhere
    from cairn.policy import History
    from cairn.policy.resume import ResumeOn, ResumePlan, ResumePolicy

log = logging.getLogger(__name__)

DEFAULT_RESCHEDULE_DELAY = timedelta(seconds=30)
# The rescheduled run has the same try number as the one that just ended. If it is already
# scheduled or queued when the scheduler reads the executor's "finished" event of the first
# run, Airflow 3.3 takes it for a task killed externally and fails it into a retry, which then
# fences the rescheduled run (seen here with a 2 s delay). The event is read within a scheduler
# loop or two; 15 s keeps the rescheduled run clear of it.
MIN_RESCHEDULE_DELAY = timedelta(seconds=15)


def resume_policy(*, resume_on: ResumeOn | str = "any_failure",
                  max_error_retries: int | None = None, loop_guard: bool = True,
                  max_preemptions: int = 0) -> ResumePolicy:
    """An operator's options as a :class:`ResumePolicy` (a ConfigError names a bad one)."""
    from cairn.policy.resume import ResumePolicy

    if not isinstance(loop_guard, bool):
        raise ConfigError(f"loop_guard must be True or False, got {loop_guard!r}")
    return ResumePolicy(resume_on=resume_on, max_error_retries=max_error_retries,
                        loop_guard=loop_guard, max_preemptions=max_preemptions)


def read_history(url: str, key: Any) -> History:
    """``key``'s tries and outcome records in the store at ``url``; empty when the store does
    not exist yet (the first try creates it). The store's credentials must be in the
    environment."""
    from cairn.exceptions import NotFound
    from cairn.policy import History
    from cairn.store import open_store

    try:
        with open_store(url, create=False) as store:
            return History.from_store(store, key)
    except NotFound:
        log.info("cairn: no store at %s yet: no history", url)
        return History()


def plan_try(history: History, policy: ResumePolicy) -> ResumePlan:
    """Plan this try from the step's ``history``; raises ``AirflowFailException`` (no retry)
    when the policy says the step must not run again."""
    from airflow.sdk.exceptions import AirflowFailException

    from cairn.policy.resume import plan_resume

    plan = plan_resume(history, policy)
    log.info("cairn: resume plan: %s", plan.reason)
    if plan.give_up:
        raise AirflowFailException(f"cairn: {plan.reason}. Fix the step, then clear the task "
                                   "(or raise max_error_retries)")
    return plan


def is_control_flow(error: BaseException) -> bool:
    """Whether ``error`` is Airflow's control flow raised by the task itself (a skip, a
    deferral, a reschedule), which must pass through untouched and count as no error."""
    from airflow.sdk.exceptions import (
        AirflowRescheduleException,
        AirflowSkipException,
        TaskDeferred,
    )

    return isinstance(error, (AirflowSkipException, AirflowRescheduleException, TaskDeferred))


def raise_verdict(plan: ResumePlan, policy: ResumePolicy, error: Exception, *,
                  delay: timedelta | None) -> None:
    """Called with the error a try ended with, before it is re-raised: raise what Airflow must
    see instead when the policy says stop (``AirflowFailException``) or reschedule
    (``AirflowRescheduleException``); return when the error should simply fail the try."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

    from cairn.policy.resume import AfterTry, after_try
    from cairn.runtime.endings import outcome_kind

    verdict = after_try(plan, policy, outcome_kind(error))
    if verdict is AfterTry.STOP:
        raise AirflowFailException(
            f"cairn: the step failed with its own error {plan.errors + 1} times, more than "
            f"max_error_retries={policy.max_error_retries}; not retrying ({error})") from error
    if verdict is AfterTry.RESCHEDULE:
        wait = delay if delay is not None and delay.total_seconds() > 0 else DEFAULT_RESCHEDULE_DELAY
        wait = max(wait, MIN_RESCHEDULE_DELAY)
        log.warning("cairn: preempted with the final snapshot committed; rescheduling in %s "
                    "without consuming a retry (%d of max_preemptions=%d)", wait,
                    plan.preemptions + 1, policy.max_preemptions)
        raise AirflowRescheduleException(
            reschedule_date=datetime.now(tz=timezone.utc) + wait) from error
