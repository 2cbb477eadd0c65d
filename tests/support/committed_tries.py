"""A try that commits a snapshot per step, for the rollback tests (ADR 0049): restore, then
``steps`` inline snapshots of a one-layer model, each durable when ``step`` returns."""

from __future__ import annotations

import torch

from cairn.state import Checkpointer
from cairn.state.checkpointer import PersistMode
from cairn.store import Key, Store


def committed_try(store: Store, key: Key, steps: int,
                  **options: object) -> tuple[Checkpointer, int]:
    """Run one try of ``steps`` committed snapshots; return its Checkpointer (still open) and
    the step it restored to."""
    model = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(store=store, key=key, every_steps=1, every_seconds=None,
                        persist=PersistMode.INLINE, preemption=None, **options)
    start = ckpt.restore(model=model)
    for step in range(start, start + steps):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.step(step)
    return ckpt, start
