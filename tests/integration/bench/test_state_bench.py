"""``bench/state_bench.py --quick`` runs end to end: its last line is one JSON object with every
figure and target, the restore target is against the faster ``torch.load`` form and the memcpy
floor against the faster thread count, each peer's configuration is named, and each
breakdown adds up to its total. No timing is asserted (the figures are the bench's business);
without root the page cache is not dropped and the bench says warm cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.bench_runs import check_adds_up, positive, run_quick

pytestmark = [pytest.mark.exclusive, pytest.mark.slow]

FIGURES = ("stall_vs_memcpy", "stall_vs_dcp_best", "restore_vs_torch_load",
           "resident_vs_torch_load_mmap", "frozen90_vs_floor", "amortized_slowdown",
           "first_stall_vs_median")
CONTENDERS = {"cairn", "cairn_inline", "torch_save", "dcp_save", "dcp_async_default",
              "dcp_async_thread_cached"}  # --quick leaves out DCP's PROCESS executor
RESTORES = {"cairn", "torch_load", "torch_load_mmap", "dcp_load"}



@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    parent = tmp_path_factory.mktemp("state-bench")
    summary, stdout = run_quick("state_bench.py", parent, timeout=600)
    return summary, stdout, parent


def test_summary_has_every_figure_and_target(run: tuple[dict[str, Any], str, Path]) -> None:
    summary, _, parent = run
    for key in (*FIGURES, "targets", "peers", "memcpy", "snapshots", "restore", "frozen90",
                "steps", "cold_cache", "torch_load_best", "dcp_best", "restore_vs_dcp_load",
                "restore_vs_torch_load_plain", "restore_vs_torch_load_mmap", "loadavg_start",
                "loadavg_end", "restore_then_train", "restore_first_step_vs_torch_load",
                "torch_load_best_first_step", "first_step_cold_cache"):
        assert key in summary, key
    assert summary["quick"] is True and summary["runs"] == 1
    for name in FIGURES:
        assert positive(summary[name]), (name, summary[name])
    assert set(summary["targets"]) == set(FIGURES)
    for name, target in summary["targets"].items():
        assert target["value"] == summary[name]
        assert target["met"] == (target["value"] <= target["target"])
    assert list(parent.iterdir()) == []  # the bench removed its directory


def test_each_target_is_against_the_best_peer(run: tuple[dict[str, Any], str, Path]) -> None:
    summary, _, _ = run
    restore = summary["restore"]
    assert set(restore) == RESTORES
    best = min(("torch_load", "torch_load_mmap"), key=lambda k: restore[k]["median_s"])
    assert summary["torch_load_best"] == best
    assert summary["restore_vs_torch_load"] == max(summary["restore_vs_torch_load_plain"],
                                                   summary["restore_vs_torch_load_mmap"])
    # Issue 39 item 5: until resident, against the mapped load (not the faster of the two).
    # The medians in the JSON are rounded to 0.1 ms, the figure is not: --quick's restores
    # take tens of milliseconds, so the two agree to about a percent.
    assert summary["resident_vs_torch_load_mmap"] == pytest.approx(
        restore["cairn"]["resident_median_s"] / restore["torch_load_mmap"]["resident_median_s"],
        rel=2e-2)
    memcpy = summary["memcpy"]
    assert "1" in memcpy["by_threads"] and len(memcpy["by_threads"]) >= 1
    fastest = min(memcpy["by_threads"].values(), key=lambda m: m["median_s"])
    assert memcpy["median_s"] == fastest["median_s"]
    cairn = summary["snapshots"]["cairn"]
    assert summary["first_stall_vs_median"] == pytest.approx(
        cairn["first_stall_s"] / cairn["stall_median_s"], rel=1e-2)
    amortized = summary["steps"]["amortized"]
    assert amortized["snapshots"] == 2 and positive(amortized["with_s"])


def test_the_first_snapshot_wait_is_set_beside_the_page_population_it_is_made_of(
        run: tuple[dict[str, Any], str, Path]) -> None:
    summary, stdout, _ = run
    populate, rates = summary["populate_s"], summary["populate_gbps"]
    assert "1" in populate and set(rates) == set(populate)
    for threads, seconds in populate.items():
        assert positive(seconds)
        assert rates[threads] == pytest.approx(summary["state_bytes"] / seconds / 1e9, rel=0.05)
    assert "page population of a fresh staging buffer" in stdout
    assert "its wait_for_warm_up" in stdout


def test_peer_configurations_are_named(run: tuple[dict[str, Any], str, Path]) -> None:
    summary, stdout, _ = run
    peers = summary["peers"]
    assert CONTENDERS <= set(peers)
    assert {f"restore_{side}" for side in RESTORES} <= set(peers)
    assert "torch.save" in peers["torch_save"] and "fsync" in peers["torch_save"]
    assert "mmap=True, weights_only=True" in peers["restore_torch_load_mmap"]
    assert "load_state_dict" in peers["restore_torch_load_mmap"]
    assert "thread_count=1" in peers["dcp_async_thread_cached"]
    for text in peers.values():
        assert text in stdout  # printed, not only in the JSON


def test_breakdowns_add_up_to_their_totals(run: tuple[dict[str, Any], str, Path]) -> None:
    summary, stdout, _ = run
    snapshots = summary["snapshots"]
    assert set(snapshots) == CONTENDERS
    for name, s in snapshots.items():
        check_adds_up(s["breakdown"])
        check_adds_up(s["first_breakdown"])
        assert s["breakdown"]["total_s"] == pytest.approx(s["durable_median_s"], abs=1e-3), name
    cairn = snapshots["cairn"]["breakdown"]["parts_s"]
    assert cairn["gather"] > 0 and cairn["stage_copy"] > 0 and cairn["wait_for_writer"] > 0
    inline = snapshots["cairn_inline"]["breakdown"]["parts_s"]
    assert inline["hash"] > 0 and inline["write"] > 0
    assert snapshots["torch_save"]["breakdown"]["parts_s"]["fsync"] > 0
    for side, r in summary["restore"].items():
        check_adds_up(r["breakdown"])
        assert r["breakdown"]["total_s"] == pytest.approx(r["median_s"], abs=1e-3), side
    cairn_restore = summary["restore"]["cairn"]["breakdown"]
    assert cairn_restore["parts_s"]["read_and_verify"] > 0
    assert cairn_restore["pool_busy_s"]["verify"] > 0
    assert summary["restore"]["torch_load_mmap"]["breakdown"]["parts_s"]["torch.load"] > 0
    assert "where time goes" in stdout


def test_restores_are_followed_by_real_training_steps(
        run: tuple[dict[str, Any], str, Path]) -> None:
    """Each side also restores and then trains two steps at once (its losses checked against
    cairn's by the bench); restore + first step is set against the faster torch.load form."""
    summary, stdout, _ = run
    first = summary["restore_then_train"]
    assert set(first) == RESTORES and summary["first_step_runs"] == 1
    for side, f in first.items():
        assert positive(f["restore_median_s"]) and len(f["step_median_s"]) == 2, (side, f)
        assert all(positive(s) for s in f["step_median_s"]), (side, f)
        (until,) = f["restore_and_first_step_runs_s"]  # one run: the median is that run
        assert until == f["restore_and_first_step_median_s"]
        assert until == pytest.approx(f["restore_median_s"] + f["step_median_s"][0], abs=2e-4)
    best = min(("torch_load", "torch_load_mmap"),
               key=lambda k: first[k]["restore_and_first_step_median_s"])
    assert summary["torch_load_best_first_step"] == best
    assert summary["restore_first_step_vs_torch_load"] == pytest.approx(
        first["cairn"]["restore_and_first_step_median_s"]
        / first[best]["restore_and_first_step_median_s"], rel=1e-3)
    assert "restore, then train" in stdout and "restore + first step cairn" in stdout
