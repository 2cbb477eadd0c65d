"""``bench/process_bench.py --quick`` runs end to end with real CRIU: its last line is the JSON
summary with every expected figure, both sides' restored processes were verified, and it leaves
no process and no file behind. No timing is asserted (the figures are the bench's business).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.process.staging import memory_headroom_bytes
from tests.support.cairn_run import can_run_criu

pytestmark = [pytest.mark.exclusive, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]

BENCH = Path(__file__).resolve().parents[3] / "bench" / "process_bench.py"
ROOM = memory_headroom_bytes()  # what the bench's staging policy and tmpfs sides see


def _cmdlines_mentioning(text: str) -> list[str]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{name}: {cmdline}")
    return found


def test_quick_bench_prints_its_summary_and_verifies_restores(tmp_path: Path) -> None:
    before_shm = [p for p in Path("/dev/shm").iterdir() if p.name.startswith("cairn-process-bench-")]
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    for key in ("frozen_ratio", "consecutive_bytes_fraction", "targets", "restore_verified",
                "sizes", "torch", "loadavg_start", "loadavg_end", "cold_cache",
                "frozen_vs_floor", "frozen_vs_floor_by_size", "floor_ms_by_size",
                "plain_best_by_size", "cairn_staging_by_size", "memory_bandwidth",
                "eager_restore_vs_plain_by_size", "lazy_next_step_vs_plain_by_size",
                "lazy_random_next_step_vs_plain_by_size", "lazy_resident_s_by_size",
                "lazy_runs_resident_s_by_size",
                "restore_fetch_mbps_by_size", "raw_disk_mbps_by_size",
                "manifest_mib_per_gib_by_size"):
        assert key in summary, key
    assert set(summary["targets"]) == {"frozen_ratio", "consecutive_bytes_fraction",
                                       "scattered_bytes_fraction", "manifest_mib_per_gib",
                                       "eager_restore_vs_plain", "lazy_next_step_vs_plain"}
    for name, target in summary["targets"].items():
        assert set(target) == {"value", "target", "met"}, name
        assert target["value"] == summary[name]
    assert summary["frozen_ratio"] > 0
    bandwidth = summary["memory_bandwidth"]
    assert bandwidth["gbps"] == max(bandwidth["single_thread_gbps"],
                                    bandwidth["all_threads_gbps"]) > 0
    assert 0 < summary["consecutive_bytes_fraction"] <= 1

    assert summary["restore_verified"] is True
    (size,) = summary["sizes"]
    assert size["size_bytes"] == 64 << 20
    assert size["restore_verified"] is True
    assert size["restores_checked"] == 5  # plain, eager, eager-copy, lazy, lazy-runs: checksummed
    # 32 KiB page chunks at about 35-39 bytes of manifest each (schema 2's chunk table).
    manifest = size["manifest_mib_per_gib"]
    assert 0.5 < manifest == summary["manifest_mib_per_gib_by_size"]["64 MiB"] < 4
    restore = size["restore"]
    (run,) = restore["runs"]
    assert set(run) == {"plain", "eager", "eager-copy", "lazy", "lazy-runs"}
    assert all(r["verified"] for r in run.values())
    assert run["lazy"]["mode"] == run["lazy-runs"]["mode"] == "lazy"
    assert run["eager"]["mode"] == run["eager-copy"]["mode"] == "eager"
    assert run["eager"]["streamed"] is True and run["eager-copy"]["streamed"] is False
    assert summary["eager_streamed"] is True and restore["eager_streamed"] is True
    for side in ("lazy", "lazy-runs"):
        assert run[side]["failure"] is None
        # Every page the lazy sides got came from cairn's handler (the image minus the small
        # images and the pages CRIU restores itself), some of it on the step's faults.
        assert 0.5 * restore["image_bytes"] < run[side]["bytes_served"] <= restore["image_bytes"]
        assert 0 < run[side]["fault_bytes"] <= run[side]["bytes_served"]
        assert run[side]["faults"] > 0
    assert restore["eager_vs_plain"] == pytest.approx(restore["eager_s"] / restore["plain_s"],
                                                      abs=1e-3)
    assert summary["eager_restore_vs_plain"] == restore["eager_vs_plain"]
    assert summary["lazy_next_step_vs_plain"] == restore["lazy_next_step_vs_plain"] > 0
    assert summary["lazy_random_next_step_vs_plain"] == \
        restore["lazy_random_next_step_vs_plain"] > 0
    assert restore["eager_copy_vs_plain"] == pytest.approx(
        restore["eager_copy_s"] / restore["plain_s"], abs=1e-3)
    assert summary["eager_copy_restore_vs_plain_by_size"]["64 MiB"] == \
        restore["eager_copy_vs_plain"]
    parts = restore["breakdown"]
    assert parts["eager_fetch_s"] + parts["eager_criu_s"] <= restore["eager_s"] + 0.01
    assert parts["eager_copy_fetch_s"] + parts["eager_copy_criu_s"] <= \
        restore["eager_copy_s"] + 0.01
    assert restore["fetch_mbps"] > 0 and restore["raw_disk_mbps"] > 0
    assert restore["streamed_mbps"] == pytest.approx(
        restore["image_bytes"] / 1e6 / restore["eager_s"], rel=0.01)
    for side in ("plain", "eager", "lazy"):
        assert restore["next_step_s"][side] >= run[side]["running_s"] > 0
    for side in ("plain", "eager", "lazy-runs"):
        assert restore["next_step_runs_s"][side] >= run[side]["running_s"] > 0
    assert restore["resident_s"]["lazy"] >= restore["lazy_running_s"]
    assert restore["resident_s"]["lazy-runs"] >= run["lazy-runs"]["running_s"]
    # Plain CRIU dumped to disk and, where 64 MiB fits in memory, to tmpfs, and the ratio is
    # against its faster medium; cairn staged where its policy (auto) said, and says why.
    fits = ROOM >= 1 << 30  # plenty for the workload and its image (between: either may be)
    by_medium = size["frozen_ms"]["plain_by_medium"]
    assert size["frozen_ms"]["plain"] == min(by_medium.values())
    assert by_medium[size["plain_best"]] == size["frozen_ms"]["plain"]
    assert list(by_medium) == size["plain_media"]
    reason = size["cairn_staging_reason"]
    assert reason.startswith("auto: ")
    assert size["cairn_staging"] == ("disk" if "page cache takes" in reason else "memory"
                                     if "headroom" in reason and ">=" in reason else "disk")
    assert summary["cairn_staging_by_size"] == {"64 MiB": size["cairn_staging"]}
    if fits:
        assert size["plain_media"] == ["disk", "tmpfs"]
    elif ROOM < 64 << 20:
        assert size["plain_media"] == ["disk"] and size["cairn_staging"] == "disk"
    assert size["floor_ms"] == summary["floor_ms_by_size"]["64 MiB"] > 0
    assert size["frozen_vs_floor"] == summary["frozen_vs_floor"] > 0
    assert abs(size["frozen_vs_floor"] * size["floor_ms"] - size["frozen_ms"]["cairn"]) < 0.1
    assert (f"criu dump to {size['plain_best']} (the faster of "
            f"{', '.join(size['plain_media'])})") in done.stdout
    parts = size["breakdown"]
    assert parts["cairn_ingest_hash_s"] > 0
    for row in size["rounds"]:  # per dump (medians of the parts need not add up)
        c = row["cairn"]
        assert abs(c["ingest_hash_s"] + c["ingest_rest_s"] - c["ingest_s"]) < 0.001
    assert [r["kind"] for r in size["rounds"]] == ["first", "contiguous", "scattered"]
    for row in size["rounds"]:
        assert row["plain"]["frozen_us"] > 0 and row["cairn"]["frozen_us"] > 0
        assert row["plain"]["bytes_written"] == row["plain"]["image_bytes"]
        assert sorted(row["order"]) == sorted(["cairn", *(f"plain-{m}"
                                                          for m in size["plain_media"])])
        assert all(d["frozen_us"] > 0 for d in row["plain_by_medium"].values())
        assert row["cairn"]["medium"] == size["cairn_staging"]
    b = size["bytes"]
    assert b["cairn_first"] > 0.9 * b["image_first"]  # nothing to dedup against yet
    assert b["cairn_consecutive"] < b["image_consecutive"]  # the parent dedups the rest
    assert b["changed_consecutive"] > 0 and b["changed_scattered"] > 0
    # 10% of pages changed at random touch 57% of the 32 KiB chunks; page deltas store about
    # the changed pages alone (ADR 0022).
    assert b["cairn_scattered"] < 0.35 * b["image_scattered"]

    torch = summary["torch"]
    if "skipped" not in torch:
        assert torch["processes"] >= 3  # the training process and its 2 DataLoader workers
        assert 0 < torch["cairn_consecutive"] < torch["image_consecutive"]

    # Everything it started is gone, and so are its directories (on disk and in /dev/shm).
    assert _cmdlines_mentioning(str(tmp_path)) == []
    assert list(tmp_path.iterdir()) == []
    assert [p for p in Path("/dev/shm").iterdir()
            if p.name.startswith("cairn-process-bench-")] == before_shm
