"""Bit-identical resume when the data pipeline draws augmentation from the global RNGs.

Each test SIGKILLs a real training run (:mod:`tests.support.rng_training`: a plain
``Checkpointer`` with ``loader=``) after a snapshot was committed, runs it again, and compares
it with an uninterrupted run: the same loss at every step after the resume point, the same
final weights. ``__getitem__`` draws from ``torch.randn``/``torch.randint``, ``numpy.random``
and ``random`` in the training process (no workers) or in the workers, and the loader has no
``generator=``, so its shuffling and worker seeds come from the global torch RNG as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.resume_runs import finish, kill_after, losses, same_weights, start

MODULE = "tests.support.rng_training"
KEY = "dag/augment/run-1/0"
TOTAL = 40  # 12 batches an epoch: the run crosses three epoch boundaries


def run(store: Path, out: Path, *options: str, total: int = TOTAL):  # noqa: ANN201 - a Popen
    return start(MODULE, str(store), KEY, str(out), "--total", str(total), *options)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    pytest.param(["--workers", "0"], id="no-workers"),
    pytest.param(["--workers", "2"], id="2-workers"),
    pytest.param(["--workers", "2", "--persistent"], id="2-persistent-workers"),
])
def test_global_rng_augmentation_resumes_bit_identical(tmp_path: Path, options: list[str]) -> None:
    reference = run(tmp_path / "ref-store", tmp_path / "ref.pt", *options)
    victim = run(tmp_path / "store", tmp_path / "out.pt", *options)
    seen = kill_after(victim, "committed 19")
    ref = losses(finish(reference))
    assert sorted(ref) == list(range(TOTAL))
    last_staged = max(int(line.split()[1]) for line in seen if line.startswith("saved "))

    lines = finish(run(tmp_path / "store", tmp_path / "out.pt", *options))
    resumed = int(next(line for line in lines if line.startswith("start ")).split()[1])
    assert 20 <= resumed <= last_staged + 1
    assert resumed % 12 != 0, "meant to resume mid-epoch"
    after = losses(lines)
    assert sorted(after) == list(range(resumed, TOTAL))
    assert after == {s: ref[s] for s in after}, "the resumed run diverged"
    assert not [line for line in lines if "not bit-identical" in line]
    same_weights(tmp_path / "ref.pt", tmp_path / "out.pt")


@pytest.mark.slow
def test_an_unseeded_iterable_dataset_resumes_and_says_why_it_is_not_exact(
        tmp_path: Path) -> None:
    victim = run(tmp_path / "store", tmp_path / "out.pt", "--iterable", total=20)
    kill_after(victim, "committed 9")
    lines = finish(run(tmp_path / "store", tmp_path / "out.pt", "--iterable", total=20))
    resumed = int(next(line for line in lines if line.startswith("start ")).split()[1])
    assert resumed >= 10
    assert sorted(losses(lines)) == list(range(resumed, 20))  # it resumed and finished
    why = [line for line in lines if "not bit-identical" in line]
    assert len(why) == 1, lines
    assert "IterableDataset UnseededStream saves no state" in why[0]
