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


def test_the_gpu_copy_takes_from_the_memory_a_staged_image_could_use(tmp_path) -> None:
    from cairn.process import staging

    room = staging.Headroom(cgroup_bytes=40 * GIB, available_bytes=100 * GIB,
                            tmpfs_free_bytes=60 * GIB)
    after = staging.after_gpu_copy(room, 30 * GIB)
    assert (after.cgroup_bytes, after.available_bytes, after.tmpfs_free_bytes) == (
        10 * GIB, 70 * GIB, 60 * GIB)
    # A 12 GiB image would fit in memory without the GPU copy, not with it: it stages on disk.
    kw = {"image_bytes": 12 * GIB, "memory_dir": str(tmp_path / "m"),
          "disk_dir": str(tmp_path / "d"), "page_cache": 0}
    assert staging.choose_staging(staging.StagingMedium.AUTO, headroom=room,
                                  **kw).medium is staging.StagingMedium.MEMORY
    assert staging.choose_staging(staging.StagingMedium.AUTO, headroom=after,
                                  **kw).medium is staging.StagingMedium.DISK
    unbounded = staging.Headroom(None, None, None)
    assert staging.after_gpu_copy(unbounded, GIB) == unbounded
