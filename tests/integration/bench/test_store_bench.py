"""``bench/store_bench.py --quick`` runs end to end: its last line is one JSON object with every
figure, the ratios are against the faster write baseline, each peer's configuration is named,
and each side's breakdown adds up to its total. No timing is asserted (the figures are the
bench's business); without root the page cache is not dropped and the bench says warm cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.bench_runs import check_adds_up, positive, run_quick

pytestmark = [pytest.mark.exclusive, pytest.mark.slow]

SIDES = {"write_serial", "write_parallel", "cairn_write", "read", "cairn_read", "restore",
         "cairn_restore"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    parent = tmp_path_factory.mktemp("store-bench")
    summary, stdout = run_quick("store_bench.py", parent, timeout=300)
    return summary, stdout, parent


def test_summary_has_every_figure_and_target(run: tuple[dict[str, Any], str, Path]) -> None:
    summary, _, parent = run
    for key in ("write_ratio", "read_ratio", "restore_ratio", "write_ratio_vs_serial",
                "write_ratio_vs_parallel", "hash_gbps", "hash_runs_gbps", "targets", "peers",
                "breakdown", "cold_cache", "writers", "loadavg_start", "loadavg_end"):
        assert key in summary, key
    assert summary["size_bytes"] == 32 << 20 and summary["runs"] == 2
    for key in ("write_ratio", "read_ratio", "restore_ratio", "write_ratio_vs_serial",
                "write_ratio_vs_parallel", "hash_gbps"):
        assert positive(summary[key]), (key, summary[key])
    assert set(summary["targets"]) == {"write_ratio", "read_ratio"}
    for name, target in summary["targets"].items():
        assert target["value"] == summary[name]
        assert target["met"] == (target["value"] >= target["target"])
    assert list(parent.iterdir()) == []  # the bench removed its directory


def test_hash_is_the_median_and_write_is_against_the_faster_baseline(
        run: tuple[dict[str, Any], str, Path]) -> None:
    summary, _, _ = run
    runs = sorted(summary["hash_runs_gbps"])
    assert len(runs) == 2 and summary["hash_gbps"] == pytest.approx(sum(runs) / 2, abs=2e-3)
    write = summary["write"]
    bases = write["baselines"]
    assert set(bases) == {"write_serial", "write_parallel"}
    assert write["baseline"] == max(bases, key=lambda side: bases[side]["mbps"])
    assert write["ratio"] == min(summary["write_ratio_vs_serial"],
                                 summary["write_ratio_vs_parallel"])
    assert summary["write_ratio"] == write["ratio"]


def test_peer_configurations_are_named(run: tuple[dict[str, Any], str, Path]) -> None:
    summary, stdout, _ = run
    peers = summary["peers"]
    assert set(peers) == SIDES
    assert "4 threads" in peers["write_parallel"] and "fsync" in peers["write_parallel"]
    assert "1 writer" in peers["write_serial"]
    for text in peers.values():
        assert text in stdout  # printed, not only in the JSON


def test_breakdowns_add_up_to_their_totals(run: tuple[dict[str, Any], str, Path]) -> None:
    summary, stdout, _ = run
    parts = summary["breakdown"]
    assert set(parts) == SIDES
    for b in parts.values():
        check_adds_up(b)
    assert parts["write_serial"]["parts_s"]["write"] > 0
    assert parts["write_serial"]["parts_s"]["fsync"] > 0
    assert parts["write_parallel"]["pool_busy_s"]["write"] > 0
    assert parts["cairn_write"]["parts_s"]["hash"] > 0
    assert parts["cairn_write"]["parts_s"]["wait_for_packs_durable"] > 0
    assert parts["cairn_read"]["pool_busy_s"]["read"] > 0
    assert parts["cairn_read"]["pool_busy_s"]["verify"] > 0
    assert parts["cairn_restore"]["parts_s"]["fsync"] > 0
    assert "where time goes" in stdout
