"""What the bench smoke tests share: one ``--quick`` run of a bench script, and the checks on
the figures and breakdowns in its last-line JSON (no timing is asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def run_quick(script: str, parent: Path, *, timeout: float, flag: str = "--quick"
              ) -> tuple[dict[str, Any], str]:
    """Run ``bench/<script> FLAG --dir parent`` (``--quick``, or a bench's ``--smoke``); its
    summary (the last line) and stdout."""
    done = subprocess.run([sys.executable, str(BENCH_DIR / script), flag, "--dir",
                           str(parent)], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_adds_up(b: dict[str, Any]) -> None:
    """A breakdown's parts add up to its total, and none is negative: they are timed on the
    measuring thread, so a part counted twice would drive the remainder ("other") below 0."""
    assert positive(b["total_s"]), b
    assert sum(b["parts_s"].values()) == pytest.approx(b["total_s"], abs=1e-3 * len(b["parts_s"]))
    assert all(v >= -1e-3 for v in b["parts_s"].values()), b
