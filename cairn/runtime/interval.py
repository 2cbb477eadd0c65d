"""The snapshot interval: Young–Daly from a measured snapshot cost and an observed MTBF."""

from __future__ import annotations

import math

from cairn.exceptions import ConfigError


def young_daly_interval(*, snapshot_cost_s: float, mtbf_s: float, lower_s: float = 60.0,
                        upper_s: float = 3600.0) -> float:
    """The snapshot interval that minimises expected lost work plus snapshot overhead:
    ``sqrt(2 × cost × MTBF)`` (Young 1974, Daly 2006), clamped to ``[lower_s, upper_s]``."""
    if snapshot_cost_s < 0 or mtbf_s <= 0:
        raise ConfigError("snapshot cost must be >= 0 and MTBF > 0")
    return min(max(math.sqrt(2.0 * snapshot_cost_s * mtbf_s), lower_s), upper_s)
