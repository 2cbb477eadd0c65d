"""What a try's outcome record takes from its environment: the placement it ran with and the
step's capacity options (what a resume may move it to)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from cairn.runtime import endings, env
from cairn.store.outcomes import Outcome, OutcomeKind


class FakeStore:
    """Stands in for a Store: keeps the outcome handed to it; its log holds nothing."""

    def __init__(self) -> None:
        self.recorded: list[Outcome] = []

    @property
    def records(self) -> FakeStore:  # its records too
        return self

    def history(self, key: Any) -> list[Any]:
        return []

    def record_outcome(self, key: Any, outcome: Outcome) -> None:
        self.recorded.append(outcome)


def test_the_placement_and_the_options_come_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.PLACEMENT_OPTION.name, "l4-on-demand")
    monkeypatch.setenv(env.PLACEMENT_REASON.name, "moved by resume request from ops")
    monkeypatch.setenv(env.PLACEMENT_OPTIONS.name, '["l4-spot", "l4-on-demand"]')
    store = FakeStore()
    assert endings.record_best_effort(store, "k", Outcome(
        epoch=3, outcome=OutcomeKind.SUSPENDED, started_at=1.0, ended_at=2.0))
    [got] = store.recorded
    assert (got.option, got.reason, got.options) == (
        "l4-on-demand", "moved by resume request from ops", ("l4-spot", "l4-on-demand"))
    assert got.summary is not None and got.summary.snapshots == 0


@pytest.mark.parametrize("text", ['"l4-spot"', "[1, 2]", "not json", '[""]'])
def test_malformed_options_are_left_out_with_a_warning(
        text: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(env.PLACEMENT_OPTIONS.name, text)
    with caplog.at_level(logging.WARNING):
        assert endings.placement_options() == ()
    assert env.PLACEMENT_OPTIONS.name in caplog.text


def test_no_options_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.PLACEMENT_OPTIONS.name, raising=False)
    assert endings.placement_options() == ()
