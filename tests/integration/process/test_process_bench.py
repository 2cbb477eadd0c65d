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

from tests.support.cairn_run import can_run_criu

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]

BENCH = Path(__file__).resolve().parents[3] / "bench" / "process_bench.py"


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
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    for key in ("frozen_ratio", "consecutive_bytes_fraction", "targets", "restore_verified",
                "sizes", "torch", "loadavg_start", "loadavg_end", "cold_cache"):
        assert key in summary, key
    assert set(summary["targets"]) == {"frozen_ratio", "consecutive_bytes_fraction"}
    for name, target in summary["targets"].items():
        assert set(target) == {"value", "target", "met"}, name
        assert target["value"] == summary[name]
    assert summary["frozen_ratio"] > 0
    assert 0 < summary["consecutive_bytes_fraction"] <= 1

    assert summary["restore_verified"] is True
    (size,) = summary["sizes"]
    assert size["size_bytes"] == 64 << 20
    assert size["restore_verified"] is True
    assert size["restores_checked"] == 2  # one plain and one cairn restore, each checksummed
    assert [r["kind"] for r in size["rounds"]] == ["first", "contiguous", "scattered"]
    for row in size["rounds"]:
        assert row["plain"]["frozen_us"] > 0 and row["cairn"]["frozen_us"] > 0
        assert row["plain"]["bytes_written"] == row["plain"]["image_bytes"]
    b = size["bytes"]
    assert b["cairn_first"] > 0.9 * b["image_first"]  # nothing to dedup against yet
    assert b["cairn_consecutive"] < b["image_consecutive"]  # the parent dedups the rest
    assert b["changed_consecutive"] > 0 and b["changed_scattered"] > 0

    torch = summary["torch"]
    if "skipped" not in torch:
        assert torch["processes"] >= 3  # the training process and its 2 DataLoader workers
        assert 0 < torch["cairn_consecutive"] < torch["image_consecutive"]

    # Everything it started is gone, and so is its directory.
    assert _cmdlines_mentioning(str(tmp_path)) == []
    assert list(tmp_path.iterdir()) == []
