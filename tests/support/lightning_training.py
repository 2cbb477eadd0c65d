"""A small, deterministic Lightning fit that resumes through CairnCheckpoint (run as a module).

``python -m tests.support.lightning_training STORE KEY OUT --max-steps N --every K`` fits a
small MLP with dropout on the noisy synthetic data of :mod:`tests.support.tiny_training`
(shuffled StatefulDataLoader, two workers; its own generator unless ``--global-rng-loader``),
with Adam and a per-step StepLR. It prints ``start GLOBAL_STEP EPOCH`` when training starts,
``loss STEP VALUE`` after each optimizer step (the loss of its last micro-batch), ``saved
STEP`` when a snapshot is staged, ``committed STEP`` when the writer process reports it
durable and ``end GLOBAL_STEP`` when fit returns, and writes the final weights to OUT.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from cairn.integrations.lightning import CairnCheckpoint
from tests.support.script_common import SnapshotLines, arguments, mlp, seed
from tests.support.tiny_training import Noisy


class TinyModule(pl.LightningModule):
    def __init__(self, *, loader_generator: bool = True) -> None:
        super().__init__()
        self.loader_generator = loader_generator
        self.net = mlp()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> StatefulDataLoader:
        generator = torch.Generator().manual_seed(2) if self.loader_generator else None
        return StatefulDataLoader(Noisy(), batch_size=16, shuffle=True, num_workers=2,
                                  generator=generator)


def cpu_trainer(max_steps: int, **options: Any) -> pl.Trainer:
    """A CPU Trainer with no logger, Lightning checkpoints, progress bar or model summary."""
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **options)


class Report(pl.Callback):
    """Prints what the test reads; must come after the CairnCheckpoint in ``callbacks``."""

    def __init__(self, cairn: CairnCheckpoint) -> None:
        self.snapshots = SnapshotLines(cairn)
        self.step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step
        print(f"start {trainer.global_step} {trainer.current_epoch}", flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            return  # accumulating: no optimizer step yet
        self.step = trainer.global_step
        print(f"loss {self.step - 1} {outputs['loss'].item():.10f}", flush=True)
        self.snapshots.report()


def main() -> int:
    parser = arguments("--max-steps")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--global-rng-loader", action="store_true",
                        help="no generator= on the loader: it seeds from the global RNG")
    args = parser.parse_args()

    seed()
    model = TinyModule(loader_generator=not args.global_rng_loader)
    cairn = CairnCheckpoint(store=args.store, key=args.key, every_steps=args.every,
                            every_seconds=None)
    trainer = cpu_trainer(args.max_steps, accumulate_grad_batches=args.accumulate,
                          callbacks=[cairn, Report(cairn)])
    trainer.fit(model)
    print(f"end {trainer.global_step}", flush=True)
    torch.save(model.state_dict(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
