"""Real torch training, SIGKILLed after a snapshot and resumed: the losses that follow and the
final weights are identical to an uninterrupted run's (shuffled StatefulDataLoader with two
workers, random augmentation, dropout, Adam and a scheduler)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
TOTAL, EVERY = 48, 5


def train(store: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.tiny_training", str(store), "dag/train/run-1/0",
         str(out), "--total", str(TOTAL), "--every", str(EVERY)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def losses(lines: list[str]) -> dict[int, str]:
    return {int(m[1]): m[2] for line in lines if (m := re.match(r"loss (\d+) (\S+)", line))}


@pytest.mark.slow
def test_killed_after_a_snapshot_resumes_bit_identical(tmp_path: Path) -> None:
    reference = train(tmp_path / "ref-store", tmp_path / "ref.pt")
    ref_out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0
    ref_losses = losses(ref_out.splitlines())
    assert sorted(ref_losses) == list(range(TOTAL))

    victim = train(tmp_path / "store", tmp_path / "victim.pt")
    assert victim.stdout is not None
    seen = []
    for line in victim.stdout:
        seen.append(line.strip())
        if line.strip() == "saved 24":
            victim.send_signal(signal.SIGKILL)
            break
    seen += [line.strip() for line in victim.stdout]
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    last_saved = max(int(line.split()[1]) for line in seen if line.startswith("saved "))
    assert not (tmp_path / "victim.pt").exists()

    resumed = train(tmp_path / "store", tmp_path / "victim.pt")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0
    lines = out.splitlines()
    assert lines[0] == f"start {last_saved + 1}"
    after = losses(lines)
    assert sorted(after) == list(range(last_saved + 1, TOTAL))
    assert after == {s: ref_losses[s] for s in after}, "the resumed run diverged"

    ref_weights = torch.load(tmp_path / "ref.pt", weights_only=True)
    got_weights = torch.load(tmp_path / "victim.pt", weights_only=True)
    assert ref_weights.keys() == got_weights.keys()
    for name in ref_weights:
        assert torch.equal(ref_weights[name], got_weights[name]), name
