"""``bench/steady_state_bench.py --smoke`` runs end to end with real torch training, cairn's
Checkpointer and torch DCP's ``async_save`` in both executors: its last line is one JSON object
with every side's figures, each snapshotting side started snapshots while the steps ran, cairn
wrote only the trainable tenth of the state after its first snapshot while DCP wrote all of
it, and the bench leaves no directory behind. No timing is asserted (the figures are the
bench's business); it drops the page cache, hence ``exclusive``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_quick

pytestmark = [pytest.mark.exclusive, pytest.mark.slow]


def test_smoke_runs_every_side_and_cairn_writes_only_what_changed(tmp_path: Path) -> None:
    summary, _ = run_quick("steady_state_bench.py", tmp_path, timeout=300, flag="--smoke")
    assert summary["bench"] == "steady_state" and summary["floor"] == 1.0
    assert set(summary["peers"]) == {"dcp_thread", "dcp_process"}
    [row] = summary["rows"]
    assert row["interval_s"] == 0.5 and row["steps"] > 0 and row["none_s"] > 0
    for side in ("cairn", "dcp_thread", "dcp_process"):
        figures = row[side]
        assert figures["snapshots"] >= 2, (side, figures)
        assert figures["steps_s"] > 0 and figures["slowdown"] > 0, (side, figures)
        assert isinstance(figures["cpu_share"], float), (side, figures)
    # A tenth of the state is trainable: cairn's later snapshots write about that (chunks
    # straddling the boundary and the RNG state a little more), DCP's every byte.
    assert 0.09 <= row["cairn"]["written_share"] <= 0.2, row["cairn"]
    assert row["dcp_thread"]["written_share"] >= 1.0 and row["dcp_process"]["written_share"] >= 1.0
    assert list(tmp_path.iterdir()) == [], "the bench left its directory behind"
