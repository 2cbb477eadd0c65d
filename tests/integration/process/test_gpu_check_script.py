"""scripts/gpu_check.py, the device check of issue 17, run here on the CPU (``--device cpu``):
no GPU is lent to these machines, so this proves the script itself works — its phases, time
boxes, per-phase JSON and final line — and that it reports, not fails, what this host lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cairn_run import can_run_criu

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"

# Its phases run benches against time boxes: it needs the whole machine.
pytestmark = [pytest.mark.exclusive, pytest.mark.slow]


def test_the_check_reports_each_phase_and_ends_with_one_json_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out",
                           str(tmp_path), "--only", "probe", "state", "remap", "bench_state",
                           "bench_process", "--bench-sizes", "64e6", "--bench-every", "8"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    phases = summary["phases"]
    assert phases["probe"]["status"] == "passed" and "inventory" in phases["probe"]
    state = phases["state"]
    assert state["status"] == "passed", state
    assert state["tensors_identical"] and state["later_steps_identical"] and state["rng_identical"]
    assert phases["remap"]["status"] == "skipped" and "--device cuda" in phases["remap"]["reason"]
    # Item 8's figures: the state's stall over its bytes at the measured copy rate (a host
    # memcpy stands in for the device-to-host copy here) ...
    bench = phases["bench_state"]["sizes"]["64e6"]
    assert bench["status"] == "passed" and 0.9 * 64e6 < bench["state_bytes"] <= 64e6
    assert bench["stall_vs_d2h"] == pytest.approx(bench["stall_s"] / bench["d2h_floor_s"],
                                                  rel=0.01)
    # ... and a process holding those bytes, snapshotted by cairn run after it filled them;
    # without a GPU there is no stall, and the figure says so rather than inventing one.
    process = phases["bench_process"]
    if can_run_criu():
        one = process["sizes"]["64e6"]
        assert one["status"] == "passed", one
        assert one["image_mb"] * 1e6 >= 64e6 and one["frozen_ms"] > 0
        assert one["gpu_stall_ms"] is None and one["stall_minus_frozen_vs_copies"] is None
    else:
        assert process["status"] == "skipped"
    for name in ("probe", "state", "remap", "bench_state", "bench_process", "summary"):
        assert json.loads((tmp_path / f"{name}.json").read_text())
