"""A real try SIGKILLed mid-run, then a try that succeeds: once ``done`` and retention removed
every snapshot record, ``cairn ls`` still tells what the killed try did (docs/adr/0031)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hang import HANG_S

KEY = "etl/train/manual__2026-12-02T00:00:00+00:00/-1"
ROOT = Path(__file__).resolve().parents[3]


def training(store: Path, *, pace: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.try_training", str(store), KEY, "--total", "24",
         "--every", "2", "--pace", str(pace)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def cairn(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "cairn.cli.main", *args], capture_output=True,
                          text=True, timeout=HANG_S)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc.stdout


@pytest.mark.slow
def test_ls_shows_the_killed_tries_snapshots_and_last_step_after_success(tmp_path: Path) -> None:
    store = tmp_path / "store"
    victim = training(store, pace=0.05)
    assert victim.stdout is not None
    committed = []
    for line in victim.stdout:
        if line.startswith("committed "):
            committed.append(int(line.split()[1]))
            if len(committed) == 5:  # two more than retention keeps
                victim.send_signal(signal.SIGKILL)
                break
    victim.communicate(timeout=60)
    assert victim.returncode == -signal.SIGKILL

    after = training(store, pace=0.0)
    out, _ = after.communicate(timeout=HANG_S)
    assert after.returncode == 0, out
    start = int(next(line for line in out.splitlines() if line.startswith("start ")).split()[1])
    assert start >= committed[-1] + 1  # resumed (the writer may have committed one more)

    [row] = json.loads(cairn("ls", str(store), "--json"))
    assert row["state"] == "done" and row["snapshots"] == 0  # every snapshot record is gone
    killed, succeeded = row["tries"]
    assert killed["outcome"] is None  # SIGKILL: it recorded nothing itself
    # What it did comes from the next try's open record: every snapshot it committed, and
    # the one the next try resumed from.
    assert killed["snapshots"] == start // 2 and killed["last_step"] == start - 1
    assert killed["snapshots"] >= 5 and killed["complete"] is False
    assert killed["bytes_written"] > 0
    assert succeeded["outcome"] == "succeeded" and succeeded["complete"] is True
    assert succeeded["last_step"] == 23 and succeeded["snapshots"] >= 1
    assert succeeded["stall_s"] is not None and succeeded["bytes_written"] > 0
    assert succeeded["resumed_step"] == start - 1 and succeeded["steps_saved"] == start
    assert succeeded["seconds_saved"] is not None and succeeded["seconds_saved"] > 0

    text = cairn("ls", str(store), KEY)
    lines = text.splitlines()
    header = lines.index(next(line for line in lines if line.lstrip().startswith("TRY")))
    first = lines[header + 1].split()
    assert first[:4] == [str(killed["epoch"]), "-", str(killed["snapshots"]), str(start - 1)]
