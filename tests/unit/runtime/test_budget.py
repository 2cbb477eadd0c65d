"""The final-snapshot budget: the grace since the notice, bounded by the notice's deadline."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.runtime.budget import FinalBudget, estimate_unmeasured


def test_the_budget_counts_down_from_the_notice() -> None:
    budget = FinalBudget(10.0, started=100.0)
    assert budget.remaining(monotonic=100.0) == 10.0
    assert budget.remaining(monotonic=104.0) == 6.0
    assert budget.remaining(monotonic=112.0) == -2.0


def test_a_notice_deadline_shortens_it() -> None:
    budget = FinalBudget(30.0, started=0.0, deadline=1000.0)
    assert budget.remaining(monotonic=1.0, wall=990.0) == 10.0
    assert budget.remaining(monotonic=1.0, wall=900.0) == 29.0  # the grace is the bound now


def test_fits() -> None:
    budget = FinalBudget(5.0, started=0.0)
    assert budget.fits(4.0, monotonic=0.5)
    assert not budget.fits(4.0, monotonic=1.5)


def test_negative_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="zero or more"):
        FinalBudget(-1.0, started=0.0)


def test_unmeasured_estimate_is_conservative() -> None:
    assert estimate_unmeasured(1_000_000_000) == pytest.approx(10.0)
