"""``bench/steady_bench.py --smoke`` runs end to end with real CRIU and the installed ``cairn``
CLI: its last line is one JSON object with every side's figures, each side that snapshots took
snapshots while the workload's steps ran, and the bench leaves no directory behind. No timing
is asserted (the figures are the bench's business); it drops the page cache, hence
``exclusive``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_quick
from tests.support.cairn_run import can_run_criu

pytestmark = [
    pytest.mark.exclusive,
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]


def test_smoke_runs_every_side_and_each_snapshots_while_the_steps_run(tmp_path: Path) -> None:
    summary, _ = run_quick("steady_bench.py", tmp_path, timeout=300, flag="--smoke")
    assert summary["bench"] == "steady" and summary["floor"] == 1.0 and summary["threads"] == 2
    assert "criu dump" in summary["peer"] and "--leave-running" in summary["peer"]
    [row] = summary["rows"]
    assert row["interval_s"] == 1.0 and row["steps"] > 0 and row["none_s"] > 0
    for side in ("cairn", "cairn-nice", "criu"):
        figures = row[side]
        assert figures["snapshots"] >= 1, (side, figures)
        assert figures["steps_s"] > 0 and figures["slowdown"] > 0, (side, figures)
        assert 0 <= figures["cpu_share"] <= 1, (side, figures)
    assert list(tmp_path.iterdir()) == [], "the bench left its directory behind"
