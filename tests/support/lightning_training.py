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

import argparse
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from cairn.integrations.lightning import CairnCheckpoint
from tests.support.tiny_training import Noisy


class TinyModule(pl.LightningModule):
    def __init__(self, *, loader_generator: bool = True) -> None:
        super().__init__()
        self.loader_generator = loader_generator
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))

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

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            return  # accumulating: no optimizer step yet
        self.step = trainer.global_step
        print(f"loss {self.step - 1} {outputs['loss'].item():.10f}", flush=True)
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
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--global-rng-loader", action="store_true",
                        help="no generator= on the loader: it seeds from the global RNG")
    args = parser.parse_args()

    torch.manual_seed(1)
    torch.set_num_threads(1)
    model = TinyModule(loader_generator=not args.global_rng_loader)
    cairn = CairnCheckpoint(store=args.store, key=args.key, every_steps=args.every,
                            every_seconds=None)
    trainer = pl.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=args.accumulate,
                         callbacks=[cairn, Report(cairn)])
    trainer.fit(model)
    print(f"end {trainer.global_step}", flush=True)
    torch.save(model.state_dict(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
