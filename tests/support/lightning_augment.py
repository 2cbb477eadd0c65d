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

import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from cairn.integrations.lightning import CairnCheckpoint
from cairn.state.checkpointer import PersistMode
from tests.support import lightning_training
from tests.support.rng_training import GlobalNoise
from tests.support.script_common import arguments, mlp, seed


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
        self.net = mlp(0.2)

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


class Report(lightning_training.Report):
    """Prints what the test reads, the lr and validation loss too; must come after the
    CairnCheckpoint in ``callbacks``."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        # The lr here reflects every scheduler step taken after the previous batch.
        print(f"lr {trainer.global_step} {trainer.optimizers[0].param_groups[0]['lr']!r}",
              flush=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            print(f"val {trainer.global_step - 1} {trainer.callback_metrics['val_loss'].item()!r}",
                  flush=True)
            self.snapshots.report()


def main() -> int:
    parser = arguments("--max-steps", every=10)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--inline", action="store_true",
                        help="persist on the training thread: durable when 'saved' prints")
    args = parser.parse_args()
    seed(global_rngs=True)
    options = {"persist": PersistMode.INLINE} if args.inline else {}
    cairn = CairnCheckpoint(store=args.store, key=args.key, every_steps=args.every,
                            every_seconds=None, **options)
    trainer = lightning_training.cpu_trainer(args.max_steps, gradient_clip_val=1.0,
                                             val_check_interval=10, num_sanity_val_steps=0,
                                             callbacks=[cairn, Report(cairn)])
    model = Module()
    trainer.fit(model, datamodule=Data(workers=args.workers, persistent=args.persistent))
    print(f"end {trainer.global_step}", flush=True)
    torch.save(model.state_dict(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
