"""Honouring suspend requests (``cairn suspend``): what both modes share.

A running try polls the store for a suspend request aimed at its epoch
(:class:`SuspendWatch`, at most every ``$CAIRN_SUSPEND_POLL``, default 5 s: one or two object
reads, no listing), takes a final snapshot and stops with the ``suspended`` outcome and exit
code 77. A try that starts while its key is held suspended stops before it opens an attempt
(:func:`held`): nothing is restored, fenced or written, and no retry's work is spent until a
resume is asked for. Reading the store may fail; a poll that fails is logged once and counts
as "no request" (the next poll tries again), so a store outage never stops training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from cairn.exceptions import CairnError, ConfigError, Suspended
from cairn.runtime import env
from cairn.runtime.durations import parse_duration
from cairn.runtime.exits import ExitCode
from cairn.store.requests import Request, Suspension
from cairn.store.timestamps import format_timestamp

log = logging.getLogger(__name__)


def poll_seconds(value: float | str | None = None) -> float:
    """The poll interval: ``value`` (seconds, or a duration text) or else
    ``$CAIRN_SUSPEND_POLL`` (default 5 s)."""
    source = "suspend_poll_seconds" if value is not None else env.SUSPEND_POLL.name
    text = value if value is not None else env.SUSPEND_POLL.get()
    assert text is not None  # the variable has a default
    return parse_duration(text, name=source)


class SuspendWatch:
    """Polls ``store`` for a suspend request for try ``epoch`` of ``key``, at most every
    ``interval_s``; once one is seen it stays seen (:attr:`request`). One thread uses it."""

    def __init__(self, store: Any, key: Any, *, epoch: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ConfigError("the suspend poll interval must be positive")
        self.store, self.key, self.epoch = store, key, epoch
        self.interval_s = interval_s
        self.request: Request | None = None
        self._clock = clock
        self._next = clock()  # the first call polls
        self._failing = False

    def poll(self) -> Request | None:
        """The request to honour, reading the store only when the interval has passed."""
        if self.request is not None:
            return self.request
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        try:
            self.request = self.store.records.pending_suspend(self.key, epoch=self.epoch)
            self._failing = False
        except (CairnError, OSError) as e:
            if not self._failing:
                log.warning("key %s: cannot look for a suspend request (%s); trying again in "
                            "%.0fs", self.key, e, self.interval_s)
            self._failing = True
        return self.request

    def again_later(self) -> None:
        """The request could not be honoured now: read the store again after the interval."""
        self.request = None
        self._next = self._clock() + self.interval_s


def describe(request: Request | None) -> str:
    """``"by X at T (why)"`` for logs and messages (None: another rank saw the request)."""
    if request is None:
        return "(seen by rank 0)"
    why = f" ({request.reason})" if request.reason else ""
    return f"by {request.by} at {format_timestamp(request.at)}{why}"


def detail(request: Request | None) -> dict[str, Any]:
    """The request as an outcome record's ``detail["suspend"]``, with how long honouring it
    took."""
    if request is None:
        return {}
    return {"by": request.by, "at": format_timestamp(request.at), "reason": request.reason,
            "latency_s": round(latency_s(request), 3)}


def latency_s(request: Request) -> float:
    """Seconds from the request's creation (the asker's clock) until now."""
    return max(time.time() - request.at, 0.0)


def honoured(request: Request | None, *, seq: int | None, what: str) -> Suspended:
    """The :class:`Suspended` a try raises once its final snapshot ``seq`` holds ``what``."""
    return Suspended(f"suspended on request {describe(request)}: final snapshot seq {seq} "
                     f"holds {what}; it resumes from there once `cairn resume` is asked for",
                     code=int(ExitCode.SUSPENDED), seq=seq)


def evicted(reason: str, *, seq: int | None, what: str) -> Suspended:
    """The :class:`Suspended` a try raises when the sidecar said its Job was suspended (a Kueue
    eviction, ADR 0028) rather than its pod preempted; ``seq`` is the final snapshot (None: the
    previous one is kept)."""
    kept = (f"final snapshot seq {seq} holds {what}" if seq is not None
            else "no final snapshot, the previous one is kept")
    return Suspended(f"{reason}: suspended, not preempted ({kept}); it resumes when the Job is "
                     "readmitted", code=int(ExitCode.SUSPENDED), seq=seq)


def held(store: Any, key: Any) -> Suspended | None:
    """The :class:`Suspended` a try that is starting must stop with, because ``key`` is held
    suspended (no resume was asked for yet); None when it may run."""
    current: Suspension | None = store.records.suspension(key)
    if current is None or not current.held:
        return None
    return Suspended(f"key {key} is suspended (asked {describe(current.suspend)}); this try "
                     f"stops before it starts. Resume it with `cairn resume STORE {key}`",
                     code=int(ExitCode.SUSPENDED), seq=None)


def held_elsewhere(key: Any) -> Suspended:
    """What a rank other than 0 raises when rank 0 found ``key`` held suspended."""
    return Suspended(f"key {key} is suspended (rank 0 found the request); this try stops "
                     "before it starts", code=int(ExitCode.SUSPENDED), seq=None)
