"""``bench/final_bench.py --smoke`` runs end to end with real CRIU and the installed ``cairn``
CLI: both cases, both sides, each cairn side's final snapshot committed after a SIGTERM with
the cost its budget expected, the consecutive case's final snapshot writing less than the
whole image (it dedups against the periodic one before it), and no directory left behind.
No timing is asserted (the figures are the bench's business); it drops the page cache, hence
``exclusive``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import positive, run_quick
from tests.support.cairn_run import can_run_criu

pytestmark = [
    pytest.mark.exclusive,
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]


def test_smoke_runs_both_cases_and_reads_each_final_snapshots_expected_cost(
        tmp_path: Path) -> None:
    summary, out = run_quick("final_bench.py", tmp_path, timeout=300, flag="--smoke")
    assert summary["bench"] == "final" and "criu dump" in summary["peer"]
    assert "--leave-running" not in summary["peer"]  # a final dump ends the process
    rows = {row["case"]: row for row in summary["rows"]}
    assert set(rows) == {"first", "consecutive"}
    for case, row in rows.items():
        [run] = row["runs"]
        for side in ("plain", "cairn"):
            assert positive(run[side]["durable_s"]), (case, side, run[side])
        assert positive(run["plain"]["dump_s"]) and run["plain"]["fsync_s"] >= 0
        assert positive(run["cairn"]["took_s"]) and positive(run["cairn"]["expected_s"])
        assert positive(row["ratio"]) and row["estimate_error_worst"] >= 0
        assert positive(row["image_bytes"]) and positive(row["floor_s"])
    assert rows["first"]["runs"][0]["cairn"]["periodic"] == 0
    assert "no snapshot measured yet" in rows["first"]["basis"]
    consecutive = rows["consecutive"]["runs"][0]["cairn"]
    assert consecutive["periodic"] >= 2 and rows["consecutive"]["basis"] == "the last snapshot took"
    assert consecutive["written_bytes"] < consecutive["image_bytes"]
    assert "final snapshot" in out
    assert list(tmp_path.iterdir()) == [], "the bench left its directory behind"
