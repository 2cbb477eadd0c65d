"""``bench/simulate.py`` end to end: the shipped trace, the small sweep, a PNG, and the last
line in the issue's JSON form. No figure is asserted beyond what the model guarantees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.hang import HANG_S

BENCH = Path(__file__).resolve().parents[3] / "bench" / "simulate.py"
STRATEGIES = ["rerun", "fixed", "adaptive", "adaptive_notice", "policy"]
FIELDS = {"goodput", "cost", "deadline_misses", "wasted_gpu_hours"}


def run_bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=HANG_S)


def test_shipped_trace_small_sweep_plot_and_last_line_json(tmp_path: Path) -> None:
    png = tmp_path / "out" / "sim.png"
    proc = run_bench("--sweep", "small", "--plot", str(png), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("SIMULATED, not measured. trace: ") and "example.csv" in lines[0]
    assert "goodput by strategy" in proc.stdout
    last = json.loads(lines[-1])
    assert list(last) == ["strategies"] and list(last["strategies"]) == STRATEGIES
    for name, figures in last["strategies"].items():
        assert set(figures) == FIELDS, name
        assert 0.0 <= figures["goodput"] <= 1.0 and figures["cost"] > 0
    # on the shipped trace (deterministic), resuming from snapshots wastes less than rerunning
    assert last["strategies"]["rerun"]["wasted_gpu_hours"] > \
        last["strategies"]["adaptive"]["wasted_gpu_hours"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_trace_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "t.csv"
    bad.write_text("option,at_s,event\na100-spot,10,meteor\n")
    proc = run_bench("--trace", str(bad), "--sweep", "none", "--no-plot", cwd=tmp_path)
    assert proc.returncode == 2
    assert "t.csv:2: event must be one of preempt, maintenance" in proc.stderr
