"""What the training scripts of ``tests.support`` share: their arguments, seeding, model and the
``loss``/``saved``/``committed`` lines the resume tests read.

The scripts run as modules from the repository root (``python -m tests.support.X``), so they
import this one as :mod:`tests.support.script_common`.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def arguments(length: str = "--total", default: int = 40, every: int = 5
              ) -> argparse.ArgumentParser:
    """A parser of ``STORE KEY OUT`` and the run's ``length`` flag and ``--every``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("out")
    parser.add_argument(length, type=int, default=default)
    parser.add_argument("--every", type=int, default=every)
    return parser


def seed(*, global_rngs: bool = False) -> None:
    """Seed torch with 1 on one thread; ``global_rngs``: numpy and ``random`` too, and send
    cairn's warnings to stdout as ``log NAME MESSAGE`` lines."""
    torch.manual_seed(1)
    torch.set_num_threads(1)
    if global_rngs:
        import numpy as np

        np.random.seed(1)
        random.seed(1)
        logging.basicConfig(level=logging.WARNING, format="log %(name)s %(message)s",
                            stream=sys.stdout)


def mlp(dropout: float = 0.1) -> torch.nn.Sequential:
    """The 8-32-1 MLP with dropout that the scripts train."""
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(32, 1))


def endless(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def train(ckpt: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Iterable[Any],
          total: int, *, scheduler: Any = None, clip: float | None = None,
          pace: float = 0.0) -> None:
    """Restore through ``ckpt`` and train to step ``total``, printing ``start STEP`` and, per
    step, ``loss STEP VALUE``, ``saved STEP`` when a snapshot is staged and ``committed STEP``
    when the writer process reports it durable. ``pace``: seconds to sleep after each step
    (a longer step, so that a test can act mid-run)."""
    step = ckpt.restore(model=model, optimizer=opt, loader=loader,
                        **({} if scheduler is None else {"scheduler": scheduler}))
    print(f"start {step}", flush=True)
    batches = endless(loader)
    while step < total:
        x, y = next(batches)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        print(f"loss {step} {loss.item():.10f}", flush=True)
        committed = ckpt.committed_step
        if ckpt.step(step):
            print(f"saved {step}", flush=True)  # staged; the writer process commits it
        if ckpt.committed_step != committed:
            print(f"committed {ckpt.committed_step}", flush=True)
        step += 1
        if pace:
            time.sleep(pace)


class SnapshotLines:
    """Prints ``saved STEP`` and ``committed STEP`` when a framework integration's (a
    CairnCheckpoint's or CairnCallback's) staged or durable step changes."""

    def __init__(self, cairn: Any) -> None:
        self.cairn = cairn
        self.saved: int | None = None
        self.committed: int | None = None

    def report(self) -> None:
        if self.cairn.saved_step != self.saved:
            self.saved = self.cairn.saved_step
            print(f"saved {self.saved}", flush=True)
        committed = self.cairn.checkpointer.committed_step
        if committed != self.committed:
            self.committed = committed
            print(f"committed {committed}", flush=True)
