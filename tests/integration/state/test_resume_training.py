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

from tests.support.hang import HANG_S

REPO = Path(__file__).resolve().parents[3]
TOTAL, EVERY = 48, 5


def train(store: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.tiny_training", str(store), "dag/train/run-1/0",
         str(out), "--total", str(TOTAL), "--every", str(EVERY), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def losses(lines: list[str]) -> dict[int, str]:
    return {int(m[1]): m[2] for line in lines if (m := re.match(r"loss (\d+) (\S+)", line))}


@pytest.mark.slow
def test_killed_after_a_snapshot_resumes_bit_identical(tmp_path: Path) -> None:
    reference = train(tmp_path / "ref-store", tmp_path / "ref.pt")
    ref_out, _ = reference.communicate(timeout=HANG_S)
    assert reference.returncode == 0
    ref_losses = losses(ref_out.splitlines())
    assert sorted(ref_losses) == list(range(TOTAL))

    victim = train(tmp_path / "store", tmp_path / "victim.pt")
    assert victim.stdout is not None
    seen = []
    for line in victim.stdout:
        seen.append(line.strip())
        if line.strip() == "committed 19":
            victim.send_signal(signal.SIGKILL)
            break
    seen += [line.strip() for line in victim.stdout]
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    last_staged = max(int(line.split()[1]) for line in seen if line.startswith("saved "))
    assert not (tmp_path / "victim.pt").exists()

    resumed = train(tmp_path / "store", tmp_path / "victim.pt")
    out, _ = resumed.communicate(timeout=HANG_S)
    assert resumed.returncode == 0
    lines = out.splitlines()
    start = int(lines[0].split()[1])
    # The writer process outlives the trainer and may still commit what was staged last.
    assert 19 + 1 <= start <= last_staged + 1, (start, last_staged)
    after = losses(lines)
    assert sorted(after) == list(range(start, TOTAL))
    assert after == {s: ref_losses[s] for s in after}, "the resumed run diverged"

    ref_weights = torch.load(tmp_path / "ref.pt", weights_only=True)
    got_weights = torch.load(tmp_path / "victim.pt", weights_only=True)
    assert ref_weights.keys() == got_weights.keys()
    for name in ref_weights:
        assert torch.equal(ref_weights[name], got_weights[name]), name


@pytest.mark.slow
def test_sigterm_takes_a_final_snapshot_then_chains_the_previous_handler(tmp_path: Path) -> None:
    """SIGTERM mid-run with a handler already installed: both run, the final snapshot holds
    the last completed step, and the resumed run loses no step."""
    reference = train(tmp_path / "ref-store", tmp_path / "ref.pt")
    ref_out, _ = reference.communicate(timeout=HANG_S)
    ref_losses = losses(ref_out.splitlines())

    victim = train(tmp_path / "store", tmp_path / "victim.pt", "--prev-handler")
    assert victim.stdout is not None
    seen = []
    for line in victim.stdout:
        seen.append(line.strip())
        if line.startswith("loss 22 "):
            victim.send_signal(signal.SIGTERM)
            break
    seen += [line.strip() for line in victim.stdout]
    victim.wait(timeout=60)
    assert victim.returncode == 143, seen[-5:]
    assert "previous handler ran" in seen
    last_step = max(losses(seen))
    assert last_step < TOTAL - 1

    from cairn.store import Key
    from cairn import open_store

    store = open_store(str(tmp_path / "store"), create=False)
    assert store.manifest(Key.parse("dag/train/run-1/0")).step == last_step, "a step was lost"
    store.close()

    resumed = train(tmp_path / "store", tmp_path / "victim.pt")
    out, _ = resumed.communicate(timeout=HANG_S)
    assert resumed.returncode == 0
    assert out.splitlines()[0] == f"start {last_step + 1}"
    after = losses(out.splitlines())
    assert after == {s: ref_losses[s] for s in range(last_step + 1, TOTAL)}
    ref_weights = torch.load(tmp_path / "ref.pt", weights_only=True)
    got_weights = torch.load(tmp_path / "victim.pt", weights_only=True)
    assert all(torch.equal(ref_weights[k], got_weights[k]) for k in ref_weights)
