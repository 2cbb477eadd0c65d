"""The wake-up pipe: set and wait from one thread or two, tokens, and — what it is for — a
signal handler that wakes the main thread cannot deadlock against it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cairn.runtime.wakeup import Wakeup

STORM = Path(__file__).parents[2] / "support" / "signal_storm.py"


def test_wait_times_out_empty_and_returns_what_was_set() -> None:
    with Wakeup() as wake:
        assert wake.wait(0) == b""
        wake.set()
        wake.set(b"s")
        assert wake.wait(0) == b"\0s"
        assert wake.wait(0) == b"", "cleared by the wait"


def test_a_set_from_another_thread_ends_a_blocking_wait() -> None:
    with Wakeup() as wake:
        timer = threading.Timer(0.1, wake.set, args=(b"x",))
        timer.start()
        started = time.monotonic()
        assert wake.wait(30) == b"x"
        assert time.monotonic() - started < 25
        timer.join()


def test_after_close_set_is_ignored_and_wait_returns_empty() -> None:
    wake = Wakeup()
    wake.close()
    wake.set()
    assert wake.wait(0) == b""
    wake.close()  # twice is harmless


def test_children_do_not_inherit_the_pipe() -> None:
    with Wakeup() as wake:
        fds = [wake._read, wake._write]
        script = "import os, sys; print([os.path.exists(f'/proc/self/fd/{fd}') for fd in " \
                 f"{fds}])"
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True, close_fds=False, timeout=60).stdout
        assert out.strip() == "[False, False]"


@pytest.mark.slow
def test_a_handler_that_wakes_the_main_thread_under_a_signal_storm_does_not_deadlock() -> None:
    # The same loop with threading.Event in place of Wakeup (``signal_storm.py event``) fails
    # here within seconds: its handler blocks on the lock that the interrupted Event.wait() or
    # clear() holds — a hang, or under this storm a RecursionError as handlers pile up.
    child = subprocess.Popen([sys.executable, str(STORM), "wakeup", "4"], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        sent, end = 0, time.monotonic() + 4
        while time.monotonic() < end and child.poll() is None:
            os.kill(child.pid, signal.SIGUSR1)
            sent += 1
            time.sleep(0.0005)
        out, _ = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail("the waiter hung under the signal storm: its handler deadlocked")
    assert child.returncode == 0
    m = re.search(r"waits=(\d+) signals=(\d+)", out)
    assert m is not None, out
    assert int(m.group(1)) > 100 and int(m.group(2)) > 100, (out, sent)
