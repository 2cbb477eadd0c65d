"""scripts/gpu_check.py, the device check of issue 17, run here on the CPU (``--device cpu``):
no GPU is lent to these machines, so this proves the script itself works — its phases, time
boxes, per-phase JSON and final line — and that it reports, not fails, what this host lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"

pytestmark = pytest.mark.slow


def test_the_check_reports_each_phase_and_ends_with_one_json_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out",
                           str(tmp_path), "--only", "probe", "state", "remap"],
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
    for name in ("probe", "state", "remap", "summary"):
        assert json.loads((tmp_path / f"{name}.json").read_text())
