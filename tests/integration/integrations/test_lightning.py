"""CairnCheckpoint end to end: a Lightning fit SIGKILLed after a snapshot resumes at the
snapshot's global step (mid-epoch, or at an epoch boundary with gradient accumulation and a
loader that seeds from the global RNG) and ends bit-identical to an uninterrupted fit: the
same loss at every step after the resume point, the same final weights."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.resume_runs import finish, kill_after, losses, same_weights, start

KEY = "dag/train/run-1/0"
MAX_STEPS = 40


def fit(store: Path, out: Path, *extra: str, max_steps: int = MAX_STEPS) -> subprocess.Popen[str]:
    return start("tests.support.lightning_training", str(store), KEY, str(out),
                 "--max-steps", str(max_steps), *extra, stderr=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize(("options", "committed", "steps_per_epoch"), [
    pytest.param(["--every", "5"], 19, 16, id="mid-epoch"),
    pytest.param(["--every", "8", "--accumulate", "2", "--global-rng-loader"], 15, 8,
                 id="epoch-boundary-accumulating-global-rng-loader"),
])
def test_killed_fit_resumes_at_the_snapshot_bit_identical(
        tmp_path: Path, options: list[str], committed: int, steps_per_epoch: int) -> None:
    pytest.importorskip("lightning.pytorch")
    reference = fit(tmp_path / "ref-store", tmp_path / "ref.pt", *options)
    victim = fit(tmp_path / "store", tmp_path / "out.pt", *options)
    seen = kill_after(victim, f"committed {committed}")
    ref_lines = finish(reference)
    ref_losses = losses(ref_lines)
    assert sorted(ref_losses) == list(range(MAX_STEPS))
    assert not (tmp_path / "out.pt").exists()
    last_staged = max(int(line.split()[1]) for line in seen if line.startswith("saved "))

    lines = finish(fit(tmp_path / "store", tmp_path / "out.pt", *options))
    _, step, epoch = lines[0].split()
    start = int(step)
    # The writer process outlives the trainer and may still commit what was staged last.
    assert committed + 1 <= start <= last_staged + 1, (start, last_staged)
    assert int(epoch) == start // steps_per_epoch  # Lightning's loop continues, not restarts
    if "--accumulate" not in options:
        assert start % steps_per_epoch != 0, "meant to resume mid-epoch"
    else:
        assert start % steps_per_epoch == 0, "meant to resume at an epoch boundary"
    after = losses(lines)
    assert sorted(after) == list(range(start, MAX_STEPS))
    assert after == {s: ref_losses[s] for s in after}, "the resumed fit diverged"
    assert lines[-1] == f"end {MAX_STEPS}"
    same_weights(tmp_path / "ref.pt", tmp_path / "out.pt")


@pytest.mark.slow
def test_a_finished_fit_is_not_trained_again(tmp_path: Path) -> None:
    """The last snapshot holds the finished loops: a retry after fit (the task failed later)
    restores it and fit returns at once, with the same weights."""
    pytest.importorskip("lightning.pytorch")
    first = finish(fit(tmp_path / "store", tmp_path / "first.pt", "--every", "4", max_steps=6))
    assert first[0] == "start 0 0" and first[-1] == "end 6"
    again = finish(fit(tmp_path / "store", tmp_path / "again.pt", "--every", "4", max_steps=6))
    assert again == ["end 6"]  # no "start": the restored fit loop is done
    same_weights(tmp_path / "first.pt", tmp_path / "again.pt")


def test_a_snapshot_wins_over_fit_ckpt_path(tmp_path: Path) -> None:
    """The first attempt starts from fit(ckpt_path=...); a retry with the same call resumes
    from the newer cairn snapshot instead of going back to the file."""
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    from cairn.integrations.lightning import CairnCheckpoint
    from tests.support.lightning_training import TinyModule, cpu_trainer

    class Starts(pl.Callback):
        def __init__(self) -> None:
            self.global_step: int | None = None

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.global_step = trainer.global_step

    def run(max_steps: int, *callbacks: pl.Callback, ckpt_path: Path | None = None) -> pl.Trainer:
        torch.manual_seed(1)
        trainer = cpu_trainer(max_steps, callbacks=list(callbacks))
        trainer.fit(TinyModule(), ckpt_path=ckpt_path)
        return trainer

    run(2).save_checkpoint(tmp_path / "init.ckpt")
    store = str(tmp_path / "store")
    first, starts = CairnCheckpoint(store=store, key=KEY, every_steps=10), Starts()
    assert run(4, first, starts, ckpt_path=tmp_path / "init.ckpt").global_step == 4
    assert starts.global_step == 2 and first.restored_step is None  # from the file
    retry, starts = CairnCheckpoint(store=store, key=KEY, every_steps=10), Starts()
    assert run(6, retry, starts, ckpt_path=tmp_path / "init.ckpt").global_step == 6
    assert retry.restored_step == 3 and starts.global_step == 4  # from the snapshot


def test_finish_marks_the_key_done(tmp_path: Path) -> None:
    """finish=True: a fit that succeeded ends the key's work (a done record, no snapshots)."""
    pytest.importorskip("lightning.pytorch")
    import torch

    from cairn.integrations.lightning import CairnCheckpoint
    from cairn.store import Key
    from cairn import open_store
    from cairn.store.slotlog import RecordKind
    from tests.support.lightning_training import TinyModule, cpu_trainer

    torch.manual_seed(1)
    callback = CairnCheckpoint(store=str(tmp_path / "store"), key=KEY, every_steps=2, finish=True)
    trainer = cpu_trainer(4, callbacks=[callback])
    trainer.fit(TinyModule())
    assert callback.saved_step == 3 and callback.checkpointer is None
    store = open_store(str(tmp_path / "store"), create=False)
    try:
        assert store.history(Key.parse(KEY))[-1].kind is RecordKind.DONE
        assert store.snapshots(Key.parse(KEY)) == []
    finally:
        store.close()


def test_without_lightning_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # a None entry makes the import fail
    monkeypatch.delitem(sys.modules, "cairn.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'cairn-resume\[lightning\]'"):
        importlib.import_module("cairn.integrations.lightning")


@pytest.mark.slow
@pytest.mark.parametrize(("options", "kill_at"), [
    # The snapshot of step 9 is due where validation and the frequency-10 plateau run.
    pytest.param(["--workers", "0"], 9, id="no-workers-resume-at-a-validation-step"),
    pytest.param(["--workers", "2", "--persistent"], 19, id="2-persistent-workers-mid-epoch"),
])
def test_global_rng_augmentation_validation_and_plateau_resume_bit_identical(
        tmp_path: Path, options: list[str], kill_at: int) -> None:
    """Issue 22's fit: augmentation from the global RNGs in ``__getitem__``, a loader with no
    generator, dropout, AdamW, clipping, validation every 10 batches and ReduceLROnPlateau on
    val_loss (with validation, and at epoch ends). SIGKILLed once the snapshot of ``kill_at``
    is durable, the rerun matches the uninterrupted fit at every step: loss, lr (every
    scheduler step, plateau included), validation loss at the same global steps, weights."""
    pytest.importorskip("lightning.pytorch")
    module = "tests.support.lightning_augment"
    flags = [*options, "--every", "10", "--inline"]
    reference = start(module, str(tmp_path / "ref-store"), KEY, str(tmp_path / "ref.pt"), *flags)
    victim = start(module, str(tmp_path / "store"), KEY, str(tmp_path / "out.pt"), *flags)
    kill_after(victim, f"saved {kill_at}")
    ref = finish(reference)
    lines = finish(start(module, str(tmp_path / "store"), KEY, str(tmp_path / "out.pt"), *flags))

    def tagged(tag: str, of: list[str]) -> dict[int, str]:
        return {int(p[1]): p[2] for p in (line.split() for line in of) if p[0] == tag}

    resumed = int(next(line for line in lines if line.startswith("start ")).split()[1])
    assert resumed == kill_at + 1
    assert sorted(tagged("loss", lines)) == list(range(resumed, 40))
    for tag in ("loss", "lr", "val"):
        want = {s: v for s, v in tagged(tag, ref).items() if s >= resumed}
        assert tagged(tag, lines) == want, f"the resumed fit's {tag} diverged"
    assert sorted(tagged("val", lines)) == [21, 33]  # each validation ran once, on time
    assert len(set(tagged("lr", ref).values())) > 5  # the schedulers did change the lr
    assert not [line for line in lines if "not bit-identical" in line]
    same_weights(tmp_path / "ref.pt", tmp_path / "out.pt")


def test_a_plain_dataloader_resumes_and_says_why_it_is_not_exact(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A plain DataLoader cannot save its position: the retry resumes the weights and loops,
    restarts the epoch's data, and says so in one line."""
    pytest.importorskip("lightning.pytorch")
    import logging

    import torch

    from cairn.integrations.lightning import CairnCheckpoint
    from tests.support.lightning_training import TinyModule, cpu_trainer
    from tests.support.tiny_training import Noisy

    class PlainLoader(TinyModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(Noisy(), batch_size=16, shuffle=True)

    def run(max_steps: int) -> CairnCheckpoint:
        torch.manual_seed(1)
        callback = CairnCheckpoint(store=str(tmp_path / "store"), key=KEY, every_steps=2)
        trainer = cpu_trainer(max_steps, callbacks=[callback])
        trainer.fit(PlainLoader())
        assert trainer.global_step == max_steps
        return callback

    assert run(4).restored_step is None
    with caplog.at_level(logging.WARNING, logger="cairn.state.loader_workers"):
        assert run(6).restored_step == 3
    why = [r.getMessage() for r in caplog.records if "not bit-identical" in r.getMessage()]
    assert len(why) == 1, why
    assert "DataLoader cannot save its position" in why[0]


def _counting() -> object:
    """An endless stateful IterableDataset: 1, 2, 3, ... each plus noise from the global torch
    RNG (its state: the last number)."""
    import torch

    class Counting(torch.utils.data.IterableDataset):
        def __init__(self) -> None:
            self.i = 0

        def __iter__(self):  # noqa: ANN204
            while True:
                self.i += 1
                yield torch.tensor([float(self.i)]) + 0.01 * torch.randn(1)

        def state_dict(self) -> dict[str, int]:
            return {"i": self.i}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.i = state["i"]

    return Counting()


def test_a_loader_without_len_resumes_at_the_batch_fetched_ahead(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Lightning fetches a batch ahead of a loader without __len__, after which the loader's
    own position counts it: the snapshot holds the position and RNGs from before that fetch,
    so the resumed fit trains that batch, augmented as in the uninterrupted fit."""
    pl = pytest.importorskip("lightning.pytorch")
    import logging

    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cairn.integrations.lightning import CairnCheckpoint
    from cairn.state.checkpointer import PersistMode
    from tests.support.lightning_training import cpu_trainer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.5),
                                           torch.nn.Linear(8, 1))
            self.seen: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen.append(float(batch[0, 0]))
            return self.net(batch).pow(2).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> StatefulDataLoader:
            return StatefulDataLoader(_counting(), batch_size=1)

    def run(store: str, max_steps: int) -> Module:
        torch.manual_seed(1)
        module = Module()
        trainer = cpu_trainer(max_steps, callbacks=[CairnCheckpoint(
            store=str(tmp_path / store), key=KEY, every_steps=2, persist=PersistMode.INLINE)])
        trainer.fit(module)
        return module

    reference = run("ref", 8)
    assert [round(v) for v in run("store", 4).seen] == [1, 2, 3, 4]
    with caplog.at_level(logging.WARNING, logger="cairn.state.loader_workers"):
        resumed = run("store", 8)
    assert resumed.seen == reference.seen[4:]  # 5 (fetched ahead of step 3's snapshot) onward
    for name, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert not [r for r in caplog.records if "not bit-identical" in r.getMessage()]
