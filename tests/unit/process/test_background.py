"""cairn.process.background: the call runs beside its caller; result() hands over its outcome."""

from __future__ import annotations

import threading

import pytest

from cairn.process.background import Background


def test_the_call_runs_beside_the_caller_and_its_value_is_handed_over_each_time() -> None:
    release = threading.Event()

    def call() -> str:
        if not release.wait(10):  # set only once the constructor has returned
            raise AssertionError("Background() waited for its call")
        return threading.current_thread().name

    pending = Background(call, name="cairn-test-call")
    release.set()
    assert pending.result() == "cairn-test-call"
    assert pending.result() == "cairn-test-call"


def test_what_the_call_raised_is_raised_by_result() -> None:
    def call() -> int:
        raise OSError("cannot read /proc/self/status")

    pending = Background(call, name="cairn-test-error")
    for _ in range(2):
        with pytest.raises(OSError, match="/proc/self/status"):
            pending.result()
