"""Preemption notices chain the previous handler only after the loop had its chance."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


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


_HAND_ON_CHILD = """
import os, signal, sys, time
from cairn.state.triggers import PreemptionNotice, PreemptionPolicy
notice = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,), budget_seconds=0.5))
notice.install()
os.kill(os.getpid(), signal.SIGUSR1)  # the default action of SIGUSR1 ends a process
time.sleep(0.05)
assert notice.pending
assert notice.hand_on() is True, "the default action was installed before ours"
assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
assert notice.hand_on() is False, "once"
print("alive after hand_on", flush=True)
if sys.argv[1] == "close":
    notice.uninstall()  # Checkpointer.close: whoever caught the exit decided
time.sleep(3)
print("alive after the budget", flush=True)
"""


def test_hand_on_leaves_a_default_action_to_the_caller_and_then_to_the_watchdog() -> None:
    """Where the signal's default action was installed, hand_on re-delivers nothing (the
    Checkpointer raises PreemptedExit instead); should that exit be caught, the watchdog still
    ends the process by the signal once the budget has run out, unless it was uninstalled."""
    import subprocess
    import sys

    caught = subprocess.run([sys.executable, "-c", _HAND_ON_CHILD, "swallow"],
                            capture_output=True, text=True, timeout=60)
    assert caught.returncode == -signal.SIGUSR1, caught.stderr
    assert caught.stdout.splitlines() == ["alive after hand_on"]
    closed = subprocess.run([sys.executable, "-c", _HAND_ON_CHILD, "close"],
                            capture_output=True, text=True, timeout=60)
    assert closed.returncode == 0, closed.stderr
    assert closed.stdout.splitlines() == ["alive after hand_on", "alive after the budget"]


def test_hand_on_calls_a_python_handler_as_chain_does() -> None:
    calls: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    notice = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,), budget_seconds=30))
    try:
        notice.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert notice.hand_on() is False and calls == [signal.SIGUSR1]
    finally:
        notice.uninstall()
        signal.signal(signal.SIGUSR1, original)


def test_hand_on_after_a_notice_file_says_whether_a_python_handler_was_there(
        tmp_path: Path) -> None:
    """A sidecar's notice with no signal: nothing is handed on; True (the Checkpointer raises
    PreemptedExit) only when no Python handler was installed before ours."""
    from cairn.runtime import channel

    for previous, expected in ((signal.SIG_DFL, True), (lambda signum, frame: None, False)):
        original = signal.signal(signal.SIGUSR1, previous)
        notice_file = tmp_path / "notice.json"
        notice = PreemptionNotice(PreemptionPolicy(signals=(signal.SIGUSR1,), budget_seconds=30,
                                                   notice_file=str(notice_file)))
        try:
            notice.install()
            now = time.time()
            channel.write_notice(str(notice_file), channel.Notice(
                source="node-label", reason="test", issued_at=now, deadline=now + 30))
            assert notice.pending and notice.signum is None
            assert notice.hand_on() is expected
            assert signal.getsignal(signal.SIGUSR1) == notice._handle  # still ours
        finally:
            notice.uninstall()
            signal.signal(signal.SIGUSR1, original)
