"""The Young–Daly interval follows the measured cost and failure rate, within its bounds."""

from __future__ import annotations

import math

import pytest

from cairn.exceptions import ConfigError
from cairn.runtime.interval import young_daly_interval


def test_young_daly() -> None:
    assert young_daly_interval(snapshot_cost_s=2.0, mtbf_s=3600.0) == pytest.approx(math.sqrt(14400))
    assert young_daly_interval(snapshot_cost_s=0.01, mtbf_s=100.0) == 60.0  # clamped low
    assert young_daly_interval(snapshot_cost_s=100.0, mtbf_s=1e6) == 3600.0  # clamped high
    with pytest.raises(ConfigError):
        young_daly_interval(snapshot_cost_s=1.0, mtbf_s=0)
