"""A training job whose data pipeline draws augmentation from the global RNGs (run as a module).

``python -m tests.support.rng_training STORE KEY OUT --workers W [--persistent]`` trains a small
MLP with dropout through :class:`cairn.state.Checkpointer` (``loader=``) on a map-style dataset
whose ``__getitem__`` adds noise from ``torch.randn``, ``numpy.random`` and Python ``random`` and
rolls the features by ``torch.randint`` — the global RNGs of whichever process runs it, as
torchvision's random transforms do. The StatefulDataLoader shuffles with no ``generator=``, so
its sampler and worker seeds come from the global torch RNG too. ``--iterable`` uses an
IterableDataset with its own unseeded randomness instead (not resumable bit-identically).
Prints ``start STEP``, ``loss STEP VALUE``, ``saved STEP`` and ``committed STEP`` like
:mod:`tests.support.tiny_training`, and writes the final weights to OUT.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from cairn.state import Checkpointer
from tests.support.script_common import arguments, mlp, seed, train


class GlobalNoise(Dataset):
    """Fixed inputs; every item augmented from the global torch, numpy and Python RNGs."""

    def __init__(self, count: int = 192) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 8, generator=g)
        self.y = (self.x.sum(dim=1, keepdim=True) > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(8)
        x = torch.roll(x, int(torch.randint(0, 2, ())))
        x = x + torch.from_numpy(np.random.normal(0.0, 0.05, 8).astype(np.float32))
        return x * (1.0 + 0.05 * random.random()), self.y[i]


class UnseededStream(IterableDataset):
    """An endless stream with its own RNG seeded from the OS: no run repeats another."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        own = random.SystemRandom()
        while True:
            x = torch.tensor([own.gauss(0.0, 1.0) for _ in range(8)])
            yield x, (x.sum(dim=0, keepdim=True) > 0).float()


def main() -> int:
    parser = arguments()
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--iterable", action="store_true")
    args = parser.parse_args()

    seed(global_rngs=True)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.iterable:
        loader = StatefulDataLoader(UnseededStream(), batch_size=16, num_workers=args.workers)
    else:
        loader = StatefulDataLoader(GlobalNoise(), batch_size=16, shuffle=True,
                                    num_workers=args.workers,
                                    persistent_workers=args.persistent and args.workers > 0)
    ckpt = Checkpointer(store=args.store, key=args.key, every_steps=args.every, every_seconds=None)
    train(ckpt, model, opt, loader, args.total, clip=1.0)
    torch.save(model.state_dict(), args.out)
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
