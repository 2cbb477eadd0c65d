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

Whatever the policy, a try whose restore failed on the worker's side
(:class:`cairn.exceptions.RestoreFailed`: a library error, a bug, out of memory; exit 8 of
``cairn run`` or of a pod) fails with ``AirflowFailException``: a retry would fail the same
way, so none is spent on it, and no snapshot was skipped (fix the cause, then clear the task).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cairn.exceptions import ConfigError
from cairn.runtime.env import SUSPEND_POLL

if TYPE_CHECKING:  # cairn.policy is imported when used: plugins load this module everywhere
    from cairn import AfterTry, ResumeOn, ResumePolicy, Try

log = logging.getLogger(__name__)

DEFAULT_RESCHEDULE_DELAY = timedelta(seconds=30)
# The rescheduled run (and a suspended task's continuation after its deferral,
# cairn_airflow.suspend) has the same try number as the one that just ended. If it is already
# scheduled or queued when the scheduler reads the executor's "finished" event of the first
# run, Airflow 3.3 takes it for a task killed externally and fails it into a retry, which then
# fences the rescheduled run (seen here with a 2 s delay). The event is read within a scheduler
# loop or two; 15 s keeps the rescheduled run clear of it.
MIN_RESCHEDULE_DELAY = timedelta(seconds=15)


#: The resume options every cairn operator takes, as their docstrings give them.
RESUME_PARAMS_DOC = f"""
    :param resume_on: ``"any_failure"`` or ``"preemption"`` (see :mod:`cairn_airflow.resume`,
        like ``max_error_retries``, ``loop_guard`` and ``max_preemptions``).
    :param resume_after: a suspended step resumes by itself this long after the suspend
        request (a timedelta, seconds or ``"2h"``; default: only on a resume request).
    :param resume_poll: how often the deferred task's trigger looks for a resume request
        (default ``${SUSPEND_POLL}`` on the worker, 5 s).
"""


def with_resume_params(doc: str | None) -> str:
    """An operator's docstring with :data:`RESUME_PARAMS_DOC` in place of its pointer."""
    pointer = "    (The resume options: :data:`cairn_airflow.resume.RESUME_PARAMS_DOC`.)\n"
    return (doc or "").replace(pointer, RESUME_PARAMS_DOC.lstrip("\n"))


def resume_policy(*, resume_on: ResumeOn | str = "any_failure",
                  max_error_retries: int | None = None, loop_guard: bool = True,
                  max_preemptions: int = 0) -> ResumePolicy:
    """An operator's options as a :class:`ResumePolicy` (a ConfigError names a bad one)."""
    from cairn import ResumePolicy

    if not isinstance(loop_guard, bool):
        raise ConfigError(f"loop_guard must be True or False, got {loop_guard!r}")
    return ResumePolicy(resume_on=resume_on, max_error_retries=max_error_retries,
                        loop_guard=loop_guard, max_preemptions=max_preemptions)


def begin_try(url: str, key: Any, policy: ResumePolicy, *, env: Mapping[str, str],
              check: bool = True, try_number: int | None = None) -> Try:
    """Read ``key``'s history in the store at ``url`` (with the store's credentials ``env``)
    and plan this try (:class:`cairn.Try`, warned when a later ``try_number`` finds no try
    in the store); with ``check``, raise ``AirflowFailException`` (no retry) when the policy
    says the step must not run again."""
    from cairn import Try
    from cairn_airflow.hooks import scoped_environ

    with scoped_environ(env):
        this_try = Try.begin(store=url, key=key, policy=policy, try_number=try_number)
    if check:
        refuse_if_given_up(this_try)
    return this_try


def refuse_if_given_up(this_try: Try) -> None:
    """``AirflowFailException`` when the resume policy gave up on the step."""
    from airflow.sdk.exceptions import AirflowFailException

    from cairn import GaveUp

    try:
        this_try.check()
    except GaveUp:
        raise AirflowFailException(f"cairn: {this_try.reason}. Fix the step, then clear the "
                                   "task (or raise max_error_retries)") from None


def is_control_flow(error: BaseException) -> bool:
    """Whether ``error`` is Airflow's control flow raised by the task itself (a skip, a
    deferral, a reschedule), which must pass through untouched and count as no error."""
    from airflow.sdk.exceptions import (
        AirflowRescheduleException,
        AirflowSkipException,
        TaskDeferred,
    )

    return isinstance(error, (AirflowSkipException, AirflowRescheduleException, TaskDeferred))


def refuse_restore_failure(error: BaseException) -> None:
    """``AirflowFailException`` (no retry) when ``error`` is a restore that failed on this
    side (:class:`~cairn.exceptions.RestoreFailed`; see the module docstring) or a rollback
    refused (:class:`~cairn.exceptions.RollbackRefused`, ADR 0049)."""
    from airflow.sdk.exceptions import AirflowFailException

    from cairn.exceptions import RestoreFailed, RollbackRefused

    if isinstance(error, (RestoreFailed, RollbackRefused)):
        raise AirflowFailException(f"cairn: {error}. Not retrying: a retry would fail the same "
                                   "way; fix the cause, then clear the task") from error


def raise_verdict(this_try: Try, verdict: AfterTry, error: Exception, *,
                  delay: timedelta | None) -> None:
    """Called with the error a try ended with and the try's verdict
    (:meth:`cairn.Try.ended`), before the error is re-raised: raise what Airflow must see
    instead when the restore failed on this side or the policy says stop
    (``AirflowFailException``) or reschedule (``AirflowRescheduleException``); return when
    the error should simply fail the try."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

    from cairn import AfterTry

    refuse_restore_failure(error)
    plan, policy = this_try.plan, this_try.policy
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
