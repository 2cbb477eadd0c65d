"""When to snapshot: preemption notices (chained signal handlers), budgets, Young–Daly.

A :class:`PreemptionNotice` handler only records that a signal arrived; the training loop's
next :meth:`~cairn.state.checkpointer.Checkpointer.step` decides whether a final snapshot fits
the time left, takes it, and only *then* hands the signal on to whatever handler was installed
before (Airflow's task runner installs one): deferring the chain is what lets the final snapshot
happen before that handler raises or the default action kills the process. If the loop does
not reach ``step()`` within the budget, a second delivery of the signal is chained at once.

On Kubernetes the sidecar container announces preemption through a notice file on the shared
volume instead (:mod:`cairn.runtime.channel`): ``pending`` also takes that file, at most twice a
second, and the budget is then also bounded by the notice's deadline. There is no signal to
chain for such a notice.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from cairn.exceptions import CairnError, ConfigError
from cairn.runtime import channel, env
from cairn.runtime.budget import FinalBudget
from cairn.runtime.wakeup import Wakeup

log = logging.getLogger(__name__)

Handler = Callable[[int, FrameType | None], Any] | int | None
FILE_POLL_S = 0.5  # how often step() may look for a sidecar's notice file


@dataclass(frozen=True)
class PreemptionPolicy:
    """Which signals announce preemption and how long a final snapshot may take.

    ``budget_seconds`` is the time from the notice until the process will be killed: the
    smaller of the platform's notice (GKE spot: about 15 s unless extended; Airflow's UI kill:
    5 s) and the pod's termination grace. A final snapshot is attempted only when its measured
    cost fits in what is left of it. ``notice_file``: a sidecar's notice file to poll (default
    ``$CAIRN_NOTICE_FILE``, read when the notice is created; ``""`` for none).
    """

    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
    budget_seconds: float = 25.0
    notice_file: str | None = None

    def __post_init__(self) -> None:
        if self.budget_seconds <= 0:
            raise ConfigError("budget_seconds must be positive")


class PreemptionNotice:
    """Installs flag-only handlers for ``policy.signals``; remembers the handlers it replaced.

    Install and uninstall from the main thread (Python's rule for signal handlers). ``pending``
    and ``received_at`` may be read from any thread.
    """

    def __init__(self, policy: PreemptionPolicy) -> None:
        self.policy = policy
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Handler] = {}
        # A plain flag, not a threading.Event: the handler runs in the main thread, which may
        # be inside that Event's lock at the time (see cairn.runtime.wakeup).
        self._raised = False
        self._chained = False
        self._default_after_budget = False  # hand_on() left the ending to the watchdog
        self._watchdog: _Watchdog | None = None
        file = policy.notice_file
        self.notice_file = env.NOTICE_FILE.get() if file is None else file
        self.notice: channel.Notice | None = None  # a sidecar's notice, once taken
        self._next_poll = 0.0
        self._poll_failed = False

    @property
    def pending(self) -> bool:
        if not self._raised and self.notice_file:
            now = time.monotonic()
            if now >= self._next_poll:
                self._next_poll = now + FILE_POLL_S
                self._take_file()
        return self._raised

    def _take_file(self) -> None:
        try:
            notice = channel.take_notice(self.notice_file)  # type: ignore[arg-type]
        except (CairnError, OSError) as e:
            if not self._poll_failed:
                log.warning("cannot read the notice file: %s", e)
            self._poll_failed = True
            return
        if notice is not None and not self._raised:
            self.notice = notice
            self.received_at = time.monotonic()
            self._raised = True

    def describe(self) -> str:
        """What the notice was: a signal's name, or the sidecar's source and reason."""
        if self.signum is not None:
            return signal.Signals(self.signum).name
        if self.notice is not None:
            return f"notice from {self.notice.source} ({self.notice.reason})"
        return "preemption notice"

    def source(self) -> str:
        """A short name for the notice's origin (a metrics label): the signal, or the
        sidecar's source."""
        if self.signum is not None:
            return signal.Signals(self.signum).name
        if self.notice is not None:
            return self.notice.source
        return "unknown"

    def install(self) -> bool:
        """Install the handlers; False (and nothing installed) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals are not watched: the Checkpointer was set up off the "
                        "main thread")
            return False
        # Started here, not in the handler: starting a thread takes locks (cairn.runtime.wakeup).
        self._watchdog = _Watchdog(self)
        for signum in self.policy.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return True

    def uninstall(self) -> None:
        """Put the replaced handlers back and stop the watchdog. Takes no lock and waits for
        no thread, so :meth:`chain` may call it from the signal handler."""
        # Taken before use: the handler may run in the middle of this and call it again.
        replaced, self._previous = self._previous, {}
        watchdog, self._watchdog = self._watchdog, None
        for signum, previous in replaced.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if watchdog is not None:
            watchdog.stop()

    def remaining(self) -> float:
        """Seconds left of the budget since the notice (the whole budget before one)."""
        if self.received_at is None:
            return self.policy.budget_seconds
        deadline = self.notice.deadline if self.notice is not None else None
        return FinalBudget(self.policy.budget_seconds, self.received_at, deadline).remaining()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._raised:
            if self.signum is None:  # a sidecar's notice came first: chain this signal later
                self.signum = signum
                return
            # A second notice (or the watchdog's): the loop did not get to step() in time.
            self.chain(frame)
            return
        self.signum = signum
        self.received_at = time.monotonic()
        self._raised = True
        if self._watchdog is not None:
            self._watchdog.arm()

    def _redeliver(self) -> None:
        # Only while our handler is still the one installed, or after hand_on() put the default
        # action back: after chain() or uninstall() the signal would reach whatever is there now.
        if self.signum is not None and (self._default_after_budget
                                        or not self._chained and self._previous):
            os.kill(os.getpid(), self.signum)

    def hand_on(self) -> bool:
        """After the final snapshot, from ``step()``: :meth:`chain`, except where the signal's
        default action was installed before ours. Then nothing is re-delivered now and True
        is returned: the caller raises :class:`~cairn.exceptions.PreemptedExit`, so the process
        exits as ``cairn run`` does (75/76) once what is above it has recorded the outcome. The
        default action is installed again (a second signal ends the process) and the watchdog
        stays armed, so should that exit be caught the signal still ends the process once the
        budget has run out (unless :meth:`uninstall` stops it first: ``Checkpointer.close``).
        A notice from the sidecar with no signal yet has nothing to hand on: True when no
        Python handler was installed before ours for any watched signal (nobody above would
        take a plain ``Preempted``), and the handlers stay as they are."""
        if self._chained:
            return False
        if self.signum is None:
            return bool(self._previous) and all(
                handler in (signal.SIG_DFL, None) for handler in self._previous.values())
        previous = self._previous.get(self.signum, signal.SIG_DFL)
        if previous not in (signal.SIG_DFL, None):
            self.chain()
            return False
        self._chained = True
        replaced, self._previous = self._previous, {}
        for signum, handler in replaced.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._default_after_budget = True
        return True

    def chain(self, frame: FrameType | None = None) -> None:
        """Hand the recorded signal to the handler that was installed before ours.

        A Python handler is called (it may raise, as Airflow's does); the default action is
        re-delivered with our handler removed, so the process ends as it would have.
        Ignored signals stay ignored. Runs at most once.
        """
        if self._chained or self.signum is None:
            return
        self._chained = True
        signum = self.signum
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            os.kill(os.getpid(), signum)
            time.sleep(1.0)  # let the default action land before anything else runs


class _Watchdog:
    """Redelivers the signal once the budget has run out, in case the loop never reached
    ``step()``. One daemon thread per install, parked on a pipe until the handler arms it.

    Arming and stopping are bytes in the pipe, not shared flags, so the thread closes the
    pipe only after it has read the stop — nothing writes to it after that.
    """

    _ARM, _STOP = b"a", b"s"

    def __init__(self, notice: PreemptionNotice) -> None:
        self._notice = notice
        self._wake = Wakeup()
        threading.Thread(target=self._run, name="cairn-preemption-watchdog", daemon=True).start()

    def arm(self) -> None:
        """From the signal handler: start counting down the budget."""
        self._wake.set(self._ARM)

    def stop(self) -> None:
        """Once, after the handlers are put back (so :meth:`arm` cannot follow)."""
        self._wake.set(self._STOP)

    def _run(self) -> None:
        armed = redelivered = False
        try:
            while True:
                counting = armed and not redelivered
                tokens = self._wake.wait(max(self._notice.remaining(), 0.0) if counting else None)
                if self._STOP in tokens:
                    return
                armed = armed or self._ARM in tokens
                if armed and not redelivered and self._notice.remaining() <= 0:
                    redelivered = True
                    self._notice._redeliver()
        finally:
            self._wake.close()


def signal_names(signals: Iterable[int]) -> str:
    return ", ".join(signal.Signals(s).name for s in signals)
