"""The GPU copy estimate from measured snapshots, and the periodic refusal it drives."""

from __future__ import annotations

import pytest

from cairn.exceptions import NotSnapshottable
from cairn.process import gpu_budget

GIB = 1 << 30


def test_before_any_measurement_the_default_rate_is_used() -> None:
    guess = gpu_budget.estimate(20 * GIB, [{"frozen_ms": 5.0}])
    assert not guess.measured and guess.bytes_per_s == gpu_budget.DEFAULT_D2H_BYTES_PER_S
    assert guess.seconds == pytest.approx(20 * GIB / 10e9)


def test_the_median_of_measured_copies_is_used() -> None:
    history = [{"gpu_bytes": 4 * GIB, "gpu_checkpoint_s": 1.0},
               {"gpu_bytes": 4 * GIB, "gpu_checkpoint_s": 2.0},
               {"gpu_bytes": 4 * GIB, "gpu_checkpoint_s": 4.0},
               {"gpu_bytes": 0, "gpu_checkpoint_s": 0.0}]  # a CPU-only dump does not count
    guess = gpu_budget.estimate(8 * GIB, history)
    assert guess.measured and guess.bytes_per_s == 2 * GIB and guess.seconds == 4.0
    assert "8.0 GiB of GPU memory at 2.1 GB/s (measured) is about 4.0s" == guess.describe(8 * GIB)


def test_a_periodic_dump_whose_copy_outlasts_the_grace_is_refused() -> None:
    history = [{"gpu_bytes": GIB, "gpu_checkpoint_s": 1.0}]
    gpu_budget.check_periodic(10 * GIB, history, grace_s=30)
    with pytest.raises(NotSnapshottable, match="longer than the 5s grace") as refused:
        gpu_budget.check_periodic(10 * GIB, history, grace_s=5)
    assert "terminationGracePeriodSeconds" in str(refused.value)
    assert "state mode" in str(refused.value)
    gpu_budget.check_periodic(10 * GIB, history, grace_s=0)  # no final snapshots: no limit
