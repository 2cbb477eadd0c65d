"""cairn.integrations.huggingface end to end: a transformers Trainer run (one-layer GPT-2,
random tokens, dropout, AdamW, linear warmup schedule) SIGKILLed after a snapshot resumes at
the snapshot's global step (mid-epoch, or at an epoch boundary with gradient accumulation),
with the dataloader fast-forwarded by transformers itself, and ends bit-identical to an
uninterrupted run: the same loss at every step after the resume point, the same weights."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import resume_runs
from tests.support.resume_runs import kill_after, losses, same_weights

KEY = "dag/train/run-1/0"
EPOCHS = 3
BATCHES_PER_EPOCH = 12  # 96 sequences, batches of 8


def train(store: Path, out: Path, *extra: str, epochs: int = EPOCHS,
          tmp: Path | None = None) -> subprocess.Popen[str]:
    return resume_runs.start("tests.support.hf_training", str(store), KEY, str(out),
                             "--epochs", str(epochs), *extra, stderr=subprocess.DEVNULL,
                             env={"TMPDIR": str(tmp)} if tmp else None)


def scratch_left(tmp: Path) -> list[str]:
    """What cairn's resume scratch left in the run's temporary folder."""
    return [p.name for p in tmp.glob("cairn-hf-*")]


def finish(proc: subprocess.Popen[str]) -> list[str]:
    """The run's lines but transformers' own (its logs, dicts printed to stdout)."""
    return [line for line in resume_runs.finish(proc) if not line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize(("options", "committed", "steps_per_epoch"), [
    pytest.param(["--every", "5"], 14, BATCHES_PER_EPOCH, id="mid-epoch"),
    pytest.param(["--every", "6", "--accumulate", "2"], 5, BATCHES_PER_EPOCH // 2,
                 id="epoch-boundary-accumulating"),
])
def test_killed_training_resumes_at_the_snapshot_bit_identical(
        tmp_path: Path, options: list[str], committed: int, steps_per_epoch: int) -> None:
    pytest.importorskip("transformers")
    total = EPOCHS * steps_per_epoch
    reference = train(tmp_path / "ref-store", tmp_path / "ref.pt", *options)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    victim = train(tmp_path / "store", tmp_path / "out.pt", *options, tmp=tmp)
    seen = kill_after(victim, f"committed {committed}")
    assert scratch_left(tmp) == [], "a run that resumed nothing made a resume scratch"
    ref_losses = losses(finish(reference))
    assert sorted(ref_losses) == list(range(total))
    assert not (tmp_path / "out.pt").exists()
    last_staged = max(int(line.split()[1]) for line in seen if line.startswith("saved "))

    lines = finish(train(tmp_path / "store", tmp_path / "out.pt", *options, tmp=tmp))
    assert scratch_left(tmp) == [], "the resume scratch outlived the training"
    start = int(lines[0].split()[1])
    # The writer process outlives the trainer and may still commit what was staged last.
    assert committed + 1 <= start <= last_staged + 1, (start, last_staged)
    if "--accumulate" in options:
        assert start % steps_per_epoch == 0, "meant to resume at an epoch boundary"
    else:
        assert start % steps_per_epoch != 0, "meant to resume mid-epoch"
    after = losses(lines)
    assert sorted(after) == list(range(start, total)), "steps were skipped or trained twice"
    assert after == {s: ref_losses[s] for s in after}, "the resumed run diverged"
    assert lines[-1] == f"end {total}"
    same_weights(tmp_path / "ref.pt", tmp_path / "out.pt")


@pytest.mark.slow
def test_a_finished_training_is_not_trained_again(tmp_path: Path) -> None:
    """The last snapshot holds the finished state: a retry after training (the task failed
    later) trains nothing and keeps the weights."""
    pytest.importorskip("transformers")
    first = finish(train(tmp_path / "store", tmp_path / "first.pt", "--every", "5", epochs=1))
    assert first[0] == "start 0" and first[-1] == f"end {BATCHES_PER_EPOCH}"
    again = finish(train(tmp_path / "store", tmp_path / "again.pt", "--every", "5", epochs=1))
    assert again[0] == f"start {BATCHES_PER_EPOCH}" and not losses(again)
    same_weights(tmp_path / "first.pt", tmp_path / "again.pt")


def test_the_callback_alone_refuses_to_train(tmp_path: Path) -> None:
    """trainer.train() cannot skip what a snapshot already trained: the callback says to use
    cairn.integrations.huggingface.train instead of resuming wrongly."""
    pytest.importorskip("transformers")
    import torch
    from transformers import Trainer, TrainingArguments

    from cairn.exceptions import ConfigError
    from cairn.integrations.huggingface import CairnCallback

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.linear(x) - labels).pow(2).mean()}

    data = [{"x": torch.randn(2), "labels": torch.randn(1)} for _ in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
                             save_strategy="no", disable_tqdm=True, max_steps=2)
    callback = CairnCallback(store=str(tmp_path / "store"), key=KEY, every_steps=1)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[callback])
    with pytest.raises(ConfigError, match="cairn.integrations.huggingface.train"):
        trainer.train()


def test_without_transformers_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # a None entry makes the import fail
    monkeypatch.delitem(sys.modules, "cairn.integrations.huggingface", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'cairn-resume\[huggingface\]'"):
        importlib.import_module("cairn.integrations.huggingface")


@pytest.mark.slow
def test_global_rng_augmentation_resumes_bit_identical(tmp_path: Path) -> None:
    """``__getitem__`` draws from torch, numpy and Python ``random`` in the training process:
    the batches fetched before the snapshot (the step's own and the one accelerate fetches
    ahead) are fetched again after the resume from the same RNG states."""
    pytest.importorskip("transformers")
    def run(store: str, out: str) -> subprocess.Popen[str]:
        return resume_runs.start("tests.support.hf_augment", str(tmp_path / store), KEY,
                                 str(tmp_path / out), "--epochs", "2", "--every", "5")

    reference, victim = run("ref-store", "ref.pt"), run("store", "out.pt")
    seen = resume_runs.kill_after(victim, "committed 9")
    ref = resume_runs.losses(resume_runs.finish(reference))
    assert sorted(ref) == list(range(2 * BATCHES_PER_EPOCH))
    last_staged = max(int(line.split()[1]) for line in seen if line.startswith("saved "))
    lines = resume_runs.finish(run("store", "out.pt"))
    resumed = int(next(line for line in lines if line.startswith("start ")).split()[1])
    assert 10 <= resumed <= last_staged + 1 and resumed % BATCHES_PER_EPOCH != 0
    after = resume_runs.losses(lines)
    assert sorted(after) == list(range(resumed, 2 * BATCHES_PER_EPOCH))
    assert after == {s: ref[s] for s in after}, "the resumed run diverged"
    assert not [line for line in lines if "not bit-identical" in line]
    same_weights(tmp_path / "ref.pt", tmp_path / "out.pt")


def start_step(lines: list[str]) -> int:
    return int(next(line for line in lines if line.startswith("start ")).split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_augmentation_in_workers_resumes_bit_identical(tmp_path: Path, persistent: bool) -> None:
    """``__getitem__`` draws from each worker's torch, numpy and Python ``random``: killed after
    the snapshot of step 5 (resumed mid-epoch, restored workers continue from their saved RNGs)
    and again after that of step 11 (resumed at the epoch boundary: fresh workers seeded from
    the same global RNGs, or persistent ones with their saved RNGs), the run ends as the
    uninterrupted one."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchdata")
    options = ["--epochs", "2", "--every", "6", "--workers", "2"] \
        + (["--persistent"] if persistent else [])

    def run(store: str, out: str, *die: str) -> subprocess.Popen[str]:
        return resume_runs.start("tests.support.hf_augment", str(tmp_path / store), KEY,
                                 str(tmp_path / out), *options, *die)

    reference = run("ref-store", "ref.pt")
    resume_runs.kill_after(run("store", "out.pt", "--die-after", "5"), "committed 5")
    mid_epoch = resume_runs.kill_after(run("store", "out.pt", "--die-after", "11"), "committed 11")
    at_boundary = resume_runs.finish(run("store", "out.pt"))
    ref = resume_runs.losses(resume_runs.finish(reference))
    assert sorted(ref) == list(range(2 * BATCHES_PER_EPOCH))
    assert (start_step(mid_epoch), start_step(at_boundary)) == (6, BATCHES_PER_EPOCH)
    for lines in (mid_epoch, at_boundary):
        after = resume_runs.losses(lines)
        assert after == {s: ref[s] for s in after}, "the resumed run diverged"
        assert not [line for line in lines if "not bit-identical" in line], lines
    assert sorted(resume_runs.losses(at_boundary)) == list(range(12, 2 * BATCHES_PER_EPOCH))
    same_weights(tmp_path / "ref.pt", tmp_path / "out.pt")


@pytest.mark.slow
def test_workers_without_torchdata_say_at_the_start_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without torchdata cairn cannot save the workers' state: a fresh training says so before
    the first step, naming the package, and trains."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from cairn.integrations.huggingface import train as cairn_train
    from cairn.state import loader_workers
    from tests.support.hf_augment import Augmented
    from tests.support.hf_training import tiny_gpt2

    monkeypatch.setattr(loader_workers, "torchdata_available", lambda: False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
                             save_strategy="no", disable_tqdm=True, max_steps=2,
                             per_device_train_batch_size=8, dataloader_num_workers=2)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Augmented())
    with caplog.at_level("WARNING", logger="cairn"):
        result = cairn_train(trainer, store=str(tmp_path / "store"), key=KEY, every_steps=1)
    assert result.global_step == 2
    why = [r.getMessage() for r in caplog.records if "not bit-identical" in r.getMessage()]
    assert len(why) == 1, why
    assert why[0].startswith("a resume of this Trainer is not bit-identical")
    assert "install torchdata" in why[0]
