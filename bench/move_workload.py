"""The state-mode try that ``move_bench.py`` suspends and moves: a torch model whose
parameters and Adam moments are about ``--state-gb`` GB, trained through ``Checkpointer``.

    python bench/move_workload.py STORE KEY --state-gb 1.5

It prints ``built 0 T`` once the model and optimizer exist, ``start STEP T`` once restored
and ``step STEP T`` after each training step (``T``: seconds since the Unix epoch), and lets :class:`cairn.exceptions.Suspended` end it (exit 77)
when a suspend request arrives (``CAIRN_SUSPEND_POLL``). Its outcome records what
``CAIRN_PLACEMENT_*`` say, as a pod's main container would.
"""

from __future__ import annotations

import argparse
import time

import torch

from cairn.state import Checkpointer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("--state-gb", type=float, default=1.5)
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    layers = 6
    # Parameters + two Adam moments: 12 bytes per parameter.
    width = int((args.state_gb * 1e9 / 12 / layers) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(4, width)
    ckpt = Checkpointer(store=args.store, key=args.key, every_steps=None, every_seconds=None)
    print(f"built 0 {time.time():.6f}", flush=True)
    step = ckpt.restore(model=model, optimizer=opt)
    print(f"start {step} {time.time():.6f}", flush=True)
    try:
        while step < args.steps:
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(step)
            print(f"step {step} {time.time():.6f}", flush=True)
            step += 1
    finally:
        ckpt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
