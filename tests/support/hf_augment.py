"""A transformers Trainer run whose dataset augments from the global RNGs (run as a module).

``python -m tests.support.hf_augment STORE KEY OUT --epochs E --every K [--workers W]
[--persistent] [--die-after STEP]``: the
one-layer GPT-2 of :mod:`tests.support.hf_training`, but each ``__getitem__`` replaces tokens
at positions drawn from ``torch.randint`` with tokens drawn from ``numpy.random`` and masks one
label drawn from Python ``random`` — the training process's global RNGs with no workers, each
worker's with ``--workers``. Prints ``start``, ``loss``, ``saved``, ``committed`` and ``end``
lines as :mod:`tests.support.hf_training` does; writes the final weights to OUT.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from tests.support.hf_training import RandomTokens, run
from tests.support.script_common import arguments, seed


class Augmented(RandomTokens):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i].clone()
        where = torch.randint(0, len(ids), (2,))
        ids[where] = torch.from_numpy(np.random.randint(0, 64, 2)).to(ids.dtype)
        labels = ids.clone()
        labels[random.randrange(len(ids))] = -100
        return {"input_ids": ids, "labels": labels}


def main() -> int:
    parser = arguments("--epochs", default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()
    seed(global_rngs=True)
    return run(args, Augmented(), max_grad_norm=1.0, dataloader_num_workers=args.workers,
               dataloader_persistent_workers=args.persistent)


if __name__ == "__main__":
    sys.exit(main())
