"""A Lightning fit of the kind issue 22 describes, resumed through CairnCheckpoint (a module).

``python -m tests.support.lightning_augment STORE KEY OUT --workers W [--persistent]``: a
``LightningDataModule`` with a shuffled StatefulDataLoader (no ``generator=``) over
:class:`tests.support.rng_training.GlobalNoise` (augmentation from the global torch, numpy and
Python RNGs in ``__getitem__``), an MLP with dropout, AdamW, gradient clipping, validation every
10 batches, a per-step StepLR, and two ``ReduceLROnPlateau`` on ``val_loss``: one stepped with
validation (interval ``step``, frequency 10), one at each epoch's end. Prints ``start
GLOBAL_STEP EPOCH``, ``loss STEP VALUE`` after each optimizer step, ``val STEP VALUE`` after each
validation, ``lr STEP VALUE`` after the plateau schedulers stepped, ``saved STEP``/``committed
STEP`` and ``end GLOBAL_STEP``; writes the final weights to OUT.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from cairn.integrations.lightning import CairnCheckpoint
from cairn.state.checkpointer import PersistMode
from tests.support.rng_training import GlobalNoise


class Data(pl.LightningDataModule):
    def __init__(self, *, workers: int, persistent: bool) -> None:
        super().__init__()
        self.workers = workers
        self.persistent = persistent

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(GlobalNoise(), batch_size=16, shuffle=True,
                                  num_workers=self.workers,
                                  persistent_workers=self.persistent and self.workers > 0)

    def val_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(GlobalNoise(count=48), batch_size=16)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
        # mode="max" on a falling loss: every validation after the first cuts the lr, so a
        # plateau step missed or repeated on resume shows in the lr at once.
        with_val = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5,
                                                              patience=0)
        at_epoch = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.8,
                                                              patience=0)
        return [opt], [
            {"scheduler": step, "interval": "step"},
            {"scheduler": with_val, "interval": "step", "frequency": 10, "monitor": "val_loss"},
            {"scheduler": at_epoch, "interval": "epoch", "monitor": "val_loss"},
        ]


class Report(pl.Callback):
    """Prints what the test reads; must come after the CairnCheckpoint in ``callbacks``."""

    def __init__(self, cairn: CairnCheckpoint) -> None:
        self.cairn = cairn
        self.saved: int | None = None
        self.committed: int | None = None
        self.step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step
        print(f"start {trainer.global_step} {trainer.current_epoch}", flush=True)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        # The lr here reflects every scheduler step taken after the previous batch.
        print(f"lr {trainer.global_step} {trainer.optimizers[0].param_groups[0]['lr']!r}",
              flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step
        print(f"loss {self.step - 1} {outputs['loss'].item():.10f}", flush=True)
        self._report()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            print(f"val {trainer.global_step - 1} {trainer.callback_metrics['val_loss'].item()!r}",
                  flush=True)
            self._report()

    def _report(self) -> None:
        if self.cairn.saved_step != self.saved:
            self.saved = self.cairn.saved_step
            print(f"saved {self.saved}", flush=True)
        committed = self.cairn.checkpointer.committed_step
        if committed != self.committed:
            self.committed = committed
            print(f"committed {committed}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("out")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--inline", action="store_true",
                        help="persist on the training thread: durable when 'saved' prints")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="log %(name)s %(message)s",
                        stream=sys.stdout)

    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    torch.set_num_threads(1)
    options = {"persist": PersistMode.INLINE} if args.inline else {}
    cairn = CairnCheckpoint(store=args.store, key=args.key, every_steps=args.every,
                            every_seconds=None, **options)
    trainer = pl.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=1.0,
                         val_check_interval=10, num_sanity_val_steps=0,
                         callbacks=[cairn, Report(cairn)])
    model = Module()
    trainer.fit(model, datamodule=Data(workers=args.workers, persistent=args.persistent))
    print(f"end {trainer.global_step}", flush=True)
    torch.save(model.state_dict(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
