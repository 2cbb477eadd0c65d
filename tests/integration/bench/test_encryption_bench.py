"""``bench/encryption_bench.py --quick`` runs end to end: its last line is one JSON object with
every figure (store write/read/restore on the disk and tmpfs with the floor, the process image
fetch, state-mode stall and restore, each sealed against plain; the CPU's ceiling), the targets as computed from
them, each peer named, and nothing left behind. No timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import positive, run_quick

pytestmark = [pytest.mark.exclusive, pytest.mark.slow]


def test_the_quick_run_reports_every_figure(tmp_path: Path) -> None:
    summary, stdout = run_quick("encryption_bench.py", tmp_path, timeout=300)
    assert summary["runs"] == 2 and set(summary["peers"]) == {"plain", "sealed", "floor"}
    sections = summary["sections"]
    for medium in ("disk", "tmpfs"):
        for op in ("write", "read", "restore"):
            row = sections[medium][op]
            assert {"plain", "sealed"} <= set(row["mbps"])
            assert len(row["runs_s"]["plain"]) == len(row["runs_s"]["sealed"]) == 2
            assert row["sealed_vs_plain"] == pytest.approx(
                row["mbps"]["sealed"] / row["mbps"]["plain"], rel=0.01)
        assert positive(sections[medium]["read"]["mbps"]["floor"])
    assert positive(sections["process_image_fetch"]["sealed_vs_plain_time"])
    state = sections["state"]
    for figure in ("stall", "durable", "restore"):
        assert positive(state[f"{figure}_sealed_vs_plain"])
        assert len(state["sealed"]["runs_s"][figure]) == 2
    cpu = sections["cpu"]
    assert set(cpu["mbps"]) == {"plain_read", "sealed_read", "plain_write", "sealed_write"}
    assert cpu["read_ceiling"] == pytest.approx(
        cpu["mbps"]["sealed_read"] / cpu["mbps"]["plain_read"], rel=0.02)
    assert summary["cpu_read_ceiling"] == cpu["read_ceiling"]
    assert f"at most {cpu['read_ceiling']}" in stdout
    for name, target in summary["targets"].items():
        assert target["value"] == summary[name]
        assert target["met"] == (target["value"] >= target["target"])
        assert name in stdout
    assert list(tmp_path.iterdir()) == []  # the bench removed what it made
