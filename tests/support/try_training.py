"""One try of a small torch training step through the try object, as ``@task.cairn`` runs it.

``python -m tests.support.try_training STORE KEY --total N --every K [--pace S]`` begins a try
(``cairn.tries.Try``), restores through its Checkpointer, trains to step ``N`` snapshotting
every ``K`` steps, then records the try's outcome and marks the key done. It prints
``start STEP`` and ``committed STEP`` when a snapshot is durable (a test SIGKILLs it there).
"""

from __future__ import annotations

import argparse
import time

import torch

from cairn.tries import Try
from tests.support.script_common import mlp, seed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("--total", type=int, default=20)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--pace", type=float, default=0.0)
    args = parser.parse_args()
    seed()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    attempt = Try.begin(store=args.store, key=args.key)
    ckpt = attempt.checkpointer(every_steps=args.every, every_seconds=None)
    error: BaseException | None = None
    try:
        step = ckpt.restore(model=model, optimizer=opt)
        print(f"start {step}", flush=True)
        committed = ckpt.committed_step
        while step < args.total:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(step)
            if ckpt.committed_step != committed:
                committed = ckpt.committed_step
                print(f"committed {committed}", flush=True)
            time.sleep(args.pace)
            step += 1
        ckpt.save(step - 1, wait=True)
    except BaseException as e:
        error = e
        raise
    finally:
        attempt.ended(error=error, ckpt=ckpt)
        if error is None:
            attempt.finish(ckpt)
        ckpt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
