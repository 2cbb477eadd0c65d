"""Preemption notices chain the previous handler only after the loop had its chance."""

from __future__ import annotations

import os
import signal
import time


from cairn.state.triggers import PreemptionNotice, PreemptionPolicy


def test_handler_only_flags_then_chains_the_previous_python_handler() -> None:
    calls: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    notice = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,), budget_seconds=30))
    try:
        assert notice.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert notice.pending and calls == [], "the previous handler waits for the final snapshot"
        assert 0 < notice.remaining() <= 30
        notice.chain()
        assert calls == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is not notice._handle
        notice.chain()
        assert calls == [signal.SIGUSR1], "chains once"
    finally:
        notice.uninstall()
        signal.signal(signal.SIGUSR1, original)


def test_second_notice_chains_at_once() -> None:
    calls: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    notice = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,), budget_seconds=30))
    try:
        notice.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert calls == [signal.SIGUSR1]
    finally:
        notice.uninstall()
        signal.signal(signal.SIGUSR1, original)


def test_ignored_signal_stays_ignored() -> None:
    original = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    notice = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,)))
    try:
        notice.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        notice.chain()  # must not kill the test process
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_watchdog_redelivers_after_the_budget_and_not_after_uninstall() -> None:
    calls: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        notice = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,), budget_seconds=0.2))
        notice.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.02)
        assert calls == [signal.SIGUSR1], "the loop never reached step(): chained by the watchdog"
        calls.clear()
        quiet = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,), budget_seconds=0.2))
        quiet.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        quiet.uninstall()
        time.sleep(0.4)
        assert calls == [], "an uninstalled notice must not redeliver"
    finally:
        signal.signal(signal.SIGUSR1, original)
