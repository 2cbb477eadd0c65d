"""The try session: the one protocol both snapshot modes drive through a try (ADR 0043).

A :class:`TrySession` is a passive state machine, with no I/O of its own: the state mode drives
it from ``Checkpointer.step``, ``cairn run`` from its supervisor's loop. It owns

* the **phase** of the try (:class:`Phase`: opening → starting → running → ending → ended, the
  diagram in ADR 0043) and refuses a step out of order;
* the **attempt**'s epoch once the mode has opened it;
* the **interval** between periodic snapshots (:meth:`due`, :meth:`snapshot_taken`);
* the **watchers** that end a try early — a preemption notice, a suspend request, the sidecar
  asked why its pod stops (:class:`CauseWatch`) — polled through :meth:`triggers`;
* the **final snapshot** under its budget (:meth:`final_snapshot`), the same decision for a
  preemption and a suspension in both modes;
* the **end**: :meth:`end` concludes the try once, through :func:`cairn.runtime.session.conclude`,
  the one mapping from how a try ended to its exit code and outcome.

Each mode hands the session a :class:`Snapshotter` (its snapshot, the snapshot's cost, whether
it can snapshot now, and stopping the workload), so the runtime never imports a mode. A
handoff to a standby and a warm start are further ways for a try to begin and end: they add a
phase here, once.

One thread drives a session.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cairn.exceptions import CairnError
from cairn.runtime import channel
from cairn.runtime.session import Conclusion, Ending, TryEnd, after_cause, conclude


class Phase(str, enum.Enum):
    """Where a try is (ADR 0043's diagram)."""

    OPENING = "opening"  # before the attempt is open: nothing fenced or restored yet
    STARTING = "starting"  # the attempt is open; restoring, or starting fresh
    RUNNING = "running"  # the workload runs; periodic snapshots
    ENDING = "ending"  # a final snapshot is being taken (a notice or a suspend request)
    ENDED = "ended"  # concluded: exit code and outcome decided


# Which phases may follow which: a step out of order is a bug in the mode that drives it.
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.OPENING: frozenset({Phase.STARTING, Phase.ENDED}),
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.ENDED}),
    Phase.RUNNING: frozenset({Phase.ENDING, Phase.ENDED}),
    Phase.ENDING: frozenset({Phase.RUNNING, Phase.ENDED}),  # RUNNING: a suspend to retry
    Phase.ENDED: frozenset(),
}


class PhaseError(CairnError):
    """A try session was driven out of order (a bug in the mode driving it)."""


@dataclass(frozen=True)
class Cost:
    """What a final snapshot is expected to take: ``seconds``, and ``basis`` (how that was
    arrived at, for the log: ``"the last snapshot took"``, or an estimate's reasoning)."""

    seconds: float
    basis: str


@dataclass(frozen=True)
class Saved:
    """A snapshot that was taken: committed as ``seq``, or handed to an uploader as spool
    ``entry`` (the uploader commits it; ``seq`` stays None until it says so)."""

    seq: int | None = None
    entry: str | None = None


class Snapshotter(Protocol):
    """What a snapshot mode hands its session. Called only from the thread driving it."""

    def cost(self) -> Cost | None:
        """The expected cost of a snapshot now; None: nothing to go by (one is tried)."""

    def blocked(self) -> str | None:
        """Why no snapshot can be taken now (a lazy restore still filling memory), or None."""

    def snapshot(self, *, final: bool, timeout_s: float | None) -> Saved | None:
        """Take a snapshot (``final``: it stops the workload); None when it failed (the mode
        logs why). Raises :class:`~cairn.exceptions.Fenced` when a newer try holds the key."""

    def stopped(self) -> bool:
        """Whether the workload has stopped (after a failed final snapshot: did it stop?)."""


class FinalVerdict(str, enum.Enum):
    """How a final snapshot went."""

    SAVED = "saved"
    BLOCKED = "blocked"  # the snapshotter could not snapshot now (Snapshotter.blocked)
    OVER_BUDGET = "over_budget"  # its cost did not fit what was left of the budget
    FAILED = "failed"  # it was tried and failed


@dataclass(frozen=True)
class Final:
    """A final snapshot's result: the verdict, what was saved, the cost it was judged by, the
    budget left when it was judged, and why it was blocked."""

    verdict: FinalVerdict
    saved: Saved | None = None
    cost: Cost | None = None
    remaining_s: float | None = None
    blocked: str | None = None


@dataclass(frozen=True)
class Triggers:
    """What the watchers saw at one poll: a preemption ``notice`` or a ``suspend`` request."""

    notice: bool = False
    suspend: bool = False


class CauseWatch:
    """Asks the pod's sidecar why the pod is stopping (``cause.json`` beside the notice file,
    ADR 0028), before the final snapshot, and reads its answer after it. ``directory`` None:
    no sidecar can answer (the watch never asks)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.asked_at: float | None = None
        self.cause: channel.Cause | None = None

    @classmethod
    def beside(cls, notice_file: str | None) -> CauseWatch:
        """The watch for the sidecar that writes ``notice_file`` (None: none)."""
        return cls(os.path.dirname(os.path.abspath(notice_file)) if notice_file else None)

    def ask(self, *, signal_name: str) -> bool:
        """Ask, when a sidecar can answer here; whether it was asked (best effort)."""
        if self.directory is None:
            return False
        self.asked_at = channel.ask_cause(self.directory, signal_name=signal_name)
        return self.asked_at is not None

    def answer(self, *, budget_left_s: float) -> channel.Cause | None:
        """The sidecar's answer to the ask, awaited while the budget allows
        (:func:`cairn.runtime.channel.cause_wait_s`); None when not asked or no answer came."""
        if self.directory is None or self.asked_at is None:
            return None
        self.cause = channel.await_cause(self.directory, self.asked_at,
                                         timeout_s=channel.cause_wait_s(budget_left_s))
        return self.cause


class TrySession:
    """One try of a key, in either mode (module docstring).

    ``every_s``: the time between periodic snapshots (None: the mode decides by other means,
    e.g. steps); ``notice`` and ``suspend``: callables that poll the watchers (truthy when the
    trigger fired; None: no such watcher); ``clock``: ``time.monotonic`` (tests pass their own).
    """

    def __init__(self, *, every_s: float | None = None,
                 notice: Callable[[], Any] | None = None,
                 suspend: Callable[[], Any] | None = None,
                 cause: CauseWatch | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.phase = Phase.OPENING
        self.epoch: int | None = None
        self.restored_from: int | None = None
        self.every_s = every_s
        self.cause = cause if cause is not None else CauseWatch(None)
        self._notice = notice
        self._suspend = suspend
        self._clock = clock
        self._last_taken: float | None = None  # when the interval last restarted
        self.conclusion: Conclusion | None = None

    # -- phases ---------------------------------------------------------------------------

    def _move(self, to: Phase) -> None:
        if to not in _NEXT[self.phase]:
            raise PhaseError(f"a try cannot go from {self.phase.value} to {to.value}")
        self.phase = to

    def opened(self, epoch: int) -> None:
        """The mode opened the try's attempt (epoch ``epoch``): older tries are fenced."""
        self._move(Phase.STARTING)
        self.epoch = epoch

    def started(self, *, restored_from: int | None) -> None:
        """The workload runs: restored from snapshot ``restored_from``, or fresh (None). The
        first periodic snapshot is due a whole interval from now."""
        self._move(Phase.RUNNING)
        self.restored_from = restored_from
        self.snapshot_taken()

    def set_watchers(self, *, notice: Callable[[], Any] | None = None,
                     suspend: Callable[[], Any] | None = None) -> None:
        """Watchers made once the attempt is open (a suspend request is for one epoch)."""
        if notice is not None:
            self._notice = notice
        if suspend is not None:
            self._suspend = suspend

    # -- running --------------------------------------------------------------------------

    def due(self, *, every_s: float | None = None) -> bool:
        """Whether a periodic snapshot is due (``every_s``: this interval instead of the
        session's, for a mode whose interval adapts)."""
        interval = self.every_s if every_s is None else every_s
        if self.phase is not Phase.RUNNING or interval is None or self._last_taken is None:
            return False
        return self._clock() >= self._last_taken + interval

    def seconds_to_due(self) -> float | None:
        """Seconds until the next periodic snapshot is due (0 when due; None: never)."""
        if self.every_s is None or self._last_taken is None:
            return None
        return max(0.0, self._last_taken + self.every_s - self._clock())

    def snapshot_taken(self) -> None:
        """A periodic snapshot was taken (or tried): the next is a whole interval away."""
        self._last_taken = self._clock()

    def defer(self, seconds: float) -> None:
        """Look again in ``seconds`` (the snapshotter was busy), not a whole interval."""
        if self.every_s is not None:
            self._last_taken = self._clock() + seconds - self.every_s

    def triggers(self) -> Triggers:
        """Poll the watchers (the notice first; the suspend request only without one)."""
        notice = bool(self._notice and self._notice())
        return Triggers(notice=notice,  # a notice goes first: the store is not read then
                        suspend=not notice and bool(self._suspend and self._suspend()))

    # -- ending ---------------------------------------------------------------------------

    def final_snapshot(self, snapshotter: Snapshotter, *, remaining_s: float | None,
                       timeout_s: float | None = None) -> Final:
        """Take the final snapshot when it fits: not while the snapshotter is blocked, not
        when its expected cost exceeds ``remaining_s`` of the budget (None: no deadline, as
        for a suspend request; a snapshot with no cost to go by is tried). ``timeout_s``:
        what the snapshot may take (default ``remaining_s``). Raises Fenced from the
        snapshotter. The try is ``ending`` from here; :meth:`carry_on` takes it back to
        running (a suspend to try again later)."""
        self._move(Phase.ENDING)
        blocked = snapshotter.blocked()
        if blocked is not None:
            return Final(FinalVerdict.BLOCKED, remaining_s=remaining_s, blocked=blocked)
        cost = snapshotter.cost() if remaining_s is not None else None
        if cost is not None and remaining_s is not None and cost.seconds > remaining_s:
            return Final(FinalVerdict.OVER_BUDGET, cost=cost, remaining_s=remaining_s)
        saved = snapshotter.snapshot(final=True,
                                     timeout_s=remaining_s if timeout_s is None else timeout_s)
        if saved is None:
            return Final(FinalVerdict.FAILED, cost=cost, remaining_s=remaining_s)
        return Final(FinalVerdict.SAVED, saved=saved, cost=cost, remaining_s=remaining_s)

    def carry_on(self) -> None:
        """The final snapshot was not taken and the workload still runs: back to running."""
        self._move(Phase.RUNNING)

    def after_cause(self, end: TryEnd, *, budget_left_s: float) -> TryEnd:
        """``end`` once the sidecar asked by :attr:`cause` answered (a preemption whose Job
        was suspended is a suspension: :func:`cairn.runtime.session.after_cause`)."""
        if end.ending is not Ending.PREEMPTED:
            return end
        return after_cause(end, self.cause.answer(budget_left_s=budget_left_s))

    def end(self, end: TryEnd) -> Conclusion:
        """Conclude the try: its exit code and outcome (:func:`cairn.runtime.session.conclude`,
        the one mapping). Once per try."""
        self._move(Phase.ENDED)
        self.conclusion = conclude(end)
        return self.conclusion
