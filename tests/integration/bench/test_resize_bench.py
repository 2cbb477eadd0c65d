"""``bench/resize_bench.py --smoke`` runs end to end: a 2-rank FSDP2 snapshot saved by cairn and
by DCP, loaded on 1 and on 3 ranks by each side, every run's whole state the source's. No
timing is asserted (the figures are the bench's business); it drops the page cache, hence
``exclusive``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.bench_runs import positive, run_quick

pytestmark = [
    pytest.mark.exclusive,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache: needs root"),
]


def test_smoke_loads_the_snapshot_on_one_and_three_ranks_both_ways(tmp_path: Path) -> None:
    summary, out = run_quick("resize_bench.py", tmp_path, timeout=600, flag="--smoke")
    assert summary["bench"] == "resize" and "dcp.load" in summary["peer"]
    assert summary["all_verified"] is True
    rows = {row["to_ranks"]: row for row in summary["rows"]}
    assert set(rows) == {1, 3}
    for row in rows.values():
        assert row["from_ranks"] == 2 and row["verified"] is True
        for field in ("dcp_ready_s", "cairn_ready_s", "ratio", "dcp_load_s", "cairn_load_s",
                      "floor_s", "state_bytes"):
            assert positive(row[field]), (field, row)
    assert "2 -> 3" in out
    assert list(tmp_path.iterdir()) == [], "the bench left its directory behind"
