"""What the entry point begins for ``cairn run`` is what the supervisor takes (ADR 0039,
amended): once, and only the checks the run asked for."""

from __future__ import annotations

import pytest

from cairn.process import doctor, host_start
from cairn.process.doctor import Check, DoctorReport, Status


@pytest.fixture(autouse=True)
def _checks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """run_doctor replaced: each call noted, answering one passed check."""
    calls: list[bool] = []

    def checks(*, preflight: bool) -> DoctorReport:
        calls.append(preflight)
        return DoctorReport((Check("criu", Status.OK, "4.1.1"),), preflight=preflight)

    monkeypatch.setattr(doctor, "run_doctor", checks)
    monkeypatch.setattr(host_start, "_begun", None)
    return calls


def test_what_was_begun_is_taken_once(_checks: list[bool]) -> None:
    host_start.begin(preflight=True)
    host_start.begin(preflight=True)  # a second call does nothing
    begun = host_start.take(preflight=True)
    assert begun.preflight is not None and begun.preflight.report().ok
    assert begun.cursor_error is None
    again = host_start.take(preflight=True)  # nothing left: begun now, a new thread
    assert again.preflight is not None and again.preflight is not begun.preflight
    again.preflight.report()
    assert _checks == [True, True]


def test_checks_begun_but_not_wanted_are_dropped(_checks: list[bool]) -> None:
    host_start.begin(preflight=True)
    assert host_start.take(preflight=False).preflight is None


def test_checks_wanted_but_not_begun_start_when_taken(_checks: list[bool]) -> None:
    host_start.begin(preflight=False)  # the workload's own --no-preflight, say
    assert _checks == []
    taken = host_start.take(preflight=True)
    assert taken.preflight is not None and taken.preflight.report().ok
    assert _checks == [True]
