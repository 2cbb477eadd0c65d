"""The snapshot interval: Young–Daly from a measured snapshot cost and an observed MTBF."""

from __future__ import annotations

import math

from cairn.exceptions import ConfigError
from cairn.store import Key, Store
from cairn.store.slotlog import RecordKind
from cairn.store.timestamps import parse_timestamp


def young_daly_interval(*, snapshot_cost_s: float, mtbf_s: float, lower_s: float = 60.0,
                        upper_s: float = 3600.0) -> float:
    """The snapshot interval that minimises expected lost work plus snapshot overhead:
    ``sqrt(2 × cost × MTBF)`` (Young 1974, Daly 2006), clamped to ``[lower_s, upper_s]``."""
    if snapshot_cost_s < 0 or mtbf_s <= 0:
        raise ConfigError("snapshot cost must be >= 0 and MTBF > 0")
    return min(max(math.sqrt(2.0 * snapshot_cost_s * mtbf_s), lower_s), upper_s)


def observed_mtbf(store: Store, key: Key) -> float | None:
    """Mean wall time in seconds between this key's attempt starts (its ``open`` records):
    every restart counts, whatever ended the try before it (a preemption, the step's own crash,
    a kill that left no outcome record), and so does the time between tries. None with fewer
    than two attempts. Not :mod:`cairn.policy`'s λ, which counts only the capacity's
    interruptions (outcome records) per hour run on one option, with a prior, to compare
    options."""
    opens = [r.created_at for r in store.history(key) if r.kind is RecordKind.OPEN]
    if len(opens) < 2:
        return None
    try:
        span = parse_timestamp(opens[-1]) - parse_timestamp(opens[0])
    except ValueError:
        return None
    return span / (len(opens) - 1) if span > 0 else None

