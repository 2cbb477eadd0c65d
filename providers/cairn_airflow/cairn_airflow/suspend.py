"""A suspended cairn task defers instead of failing (issue 19; docs/adr/0027).

When a try's step ends ``suspended`` (``cairn suspend`` or the snapshots page asked for it:
state mode raised :class:`cairn.exceptions.Suspended`, ``cairn run`` or the pod's main
container exited 77) or the key is held suspended when the try starts, the operator calls
:meth:`SuspendDeferral.defer_suspended`: the task instance goes ``deferred`` with a
:class:`~cairn_airflow.triggers.CairnResumeTrigger`, so its worker slot, GPU or pod is free
while it waits, and no retry is used (Airflow keeps the try number across a deferral). When
the trigger fires (a resume request, or ``resume_after``), Airflow runs
:meth:`SuspendDeferral.resume_suspended` on a worker, which runs the step again through the
operator's own ``execute``: it resumes from the suspend snapshot.

The trigger fires no sooner than :data:`~cairn_airflow.resume.MIN_RESCHEDULE_DELAY` (15 s)
after the deferral, whenever the resume is asked for: Airflow 3.3 takes a continuation queued
under the same try number before the scheduler has read the deferred run's "finished" event
for a task killed externally, and fails it into a retry (seen here when the resume came at
once). The deferral's timeout is what is left of the task's ``execution_timeout`` (none without
one), since Airflow counts time spent deferred against it; when it fires, the task fails
without a retry with a message that says how to go on (the suspension and its snapshot are
kept). The trigger looks at the store every ``resume_poll`` (default ``$CAIRN_SUSPEND_POLL``,
5 s).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime.env import SECRET_FILE
from cairn_airflow.resume import MIN_RESCHEDULE_DELAY
from cairn_airflow.task_keys import task_key

log = logging.getLogger(__name__)

RESUME_METHOD = "resume_suspended"
RESUMED_BY_TIME = "airflow (resume_after)"


def optional_seconds(value: timedelta | float | str | None, name: str) -> float | None:
    """``value`` (a timedelta, seconds or a duration text such as ``"2h"``) in seconds."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    from cairn.runtime.durations import parse_duration

    return parse_duration(value, name=name)


def deferral_timeout(operator: Any, context: Any, *,
                     now: datetime | None = None) -> timedelta | None:
    """What is left of ``operator.execution_timeout`` for this run of the task instance
    (from its ``start_date``), None without one. Raises ``AirflowFailException`` when nothing
    is left."""
    limit = getattr(operator, "execution_timeout", None)
    if limit is None:
        return None
    ti = context["ti"]
    started = getattr(ti, "start_date", None)
    now = now or datetime.now(tz=timezone.utc)
    left = limit - (now - started) if started is not None else limit
    if left.total_seconds() <= 0:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(
            f"cairn: the step was suspended with none of the task's execution_timeout "
            f"({limit}) left to wait in; its suspend snapshot is kept: resume it (`cairn "
            "resume` or the snapshots page), then clear the task")
    return left


class SuspendDeferral:
    """Operator mixin: defer a suspended try, continue it on a worker once it may resume.

    The operator sets ``resume_after`` (seconds, or None) and ``resume_poll`` (seconds, or None
    for ``$CAIRN_SUSPEND_POLL``) and calls :meth:`defer_suspended` where its try ended
    suspended; :meth:`resume_suspended` runs ``self.execute(context)`` again.
    """

    resume_after: float | None = None
    resume_poll: float | None = None

    def defer_suspended(self, context: Any, *, store_url: str, key: Any,
                        env: Any = None) -> None:
        """Raise ``TaskDeferred`` with a resume trigger for ``key``'s suspension (one already
        resumed fires at the trigger's first look). When the store shows no suspension at all
        (the key was discarded or marked done meanwhile), return: the caller decides."""
        from cairn import open_store
        from cairn.runtime.suspend import poll_seconds
        from cairn_airflow.hooks import scoped_environ
        from cairn_airflow.triggers import CairnResumeTrigger

        with scoped_environ(env or {}), open_store(store_url, create=False) as store:
            current = store.records.suspension(key)
        if current is None:
            log.info("cairn: %s ended suspended but is no longer suspended", key)
            return
        ask = current.suspend
        why = f" ({ask.reason})" if ask.reason else ""
        timeout = deferral_timeout(self, context)
        after = None if self.resume_after is None else ask.at + self.resume_after
        poll = self.resume_poll if self.resume_poll is not None else poll_seconds()
        # Not sooner: the scheduler must read this run's "finished" event before the
        # continuation is queued under the same try number (see MIN_RESCHEDULE_DELAY).
        not_before = time.time() + MIN_RESCHEDULE_DELAY.total_seconds()
        log.warning("cairn: %s suspended on request by %s%s; deferring until it is "
                    "resumed%s%s, with no retry used", key, ask.by, why,
                    "" if after is None else f" or {self.resume_after:g}s after the request",
                    "" if timeout is None else f", for at most {timeout} (execution_timeout)")
        self.defer(  # type: ignore[attr-defined]
            trigger=CairnResumeTrigger(store_url=store_url, key=str(key), epoch=ask.epoch,
                                       resume_after=after, poll_seconds=poll,
                                       not_before=not_before,
                                       secret_file=SECRET_FILE.get({**os.environ,
                                                                    **(env or {})}) or None),
            method_name=RESUME_METHOD, timeout=timeout)

    def resume_suspended(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        """The deferral ended: the step may run again (and resumes from the suspend
        snapshot). At ``resume_after``, this asks for the resume first."""
        event = dict(event or {})
        status = event.get("status")
        if status == "resume_after":
            self._resume_by_time(context)
        elif status == "resumed":
            why = f" ({event['reason']})" if event.get("reason") else ""
            log.info("cairn: resumed by %s at %s%s; running the step again", event.get("by"),
                     event.get("at"), why)
        else:
            log.info("cairn: no longer held (%s); running the step again",
                     event.get("reason", status))
        return self.execute(context)  # type: ignore[attr-defined]

    def _resume_by_time(self, context: Any) -> None:
        from cairn import open_store
        from cairn_airflow.hooks import scoped_environ

        key = task_key(context)
        config = self.store_config()  # type: ignore[attr-defined]
        try:
            with scoped_environ(config.env), open_store(config.url, create=False) as store:
                store.records.request_resume(key, by=RESUMED_BY_TIME,
                                     reason=f"resume_after={self.resume_after:g}s passed")
        except ConfigError as e:  # resumed or released meanwhile: nothing to lift
            log.info("cairn: resume_after passed; %s", e)
        log.info("cairn: resume_after passed; running the step again")

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None,
                         context: Any) -> Any:
        """Airflow's resume entry point; a deferral of a suspended step that timed out fails
        without a retry, saying how to go on."""
        from airflow.sdk.exceptions import AirflowFailException, TaskDeferralTimeout

        try:
            return super().resume_execution(next_method, next_kwargs,  # type: ignore[misc]
                                            context)
        except TaskDeferralTimeout as e:

            if not self._held(context):
                raise  # another deferral's timeout (the KPO's own deferrable mode)
            raise AirflowFailException(
                f"cairn: {task_key(context)} stayed suspended until the task's "
                f"execution_timeout ({getattr(self, 'execution_timeout', None)}) ran out, so "
                "Airflow ended the wait. The suspension and its snapshot are kept: resume it "
                "(`cairn resume STORE KEY` or the snapshots page), then clear the task; it "
                "continues from the suspend snapshot") from e

    def _held(self, context: Any) -> bool:
        """Whether the task's key is held suspended (False when the store cannot be read:
        Airflow's own error is raised then)."""
        from cairn import open_store
        from cairn.exceptions import CairnError
        from cairn_airflow.hooks import scoped_environ

        try:
            config = self.store_config()  # type: ignore[attr-defined]
            with scoped_environ(config.env), open_store(config.url, create=False) as store:
                current = store.records.suspension(task_key(context))
        except (CairnError, OSError):
            return False
        return current is not None and current.held
