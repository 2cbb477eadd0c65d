"""An ordinary torch training script that knows nothing of cairn (run by process_training.py).

It trains a small MLP on synthetic data for ``--steps`` steps and prints its progress. With
``--progress-log FILE`` it also appends ``<pid> <step> <unix time>`` to FILE after every step,
opening and closing it each time (a file held open would be part of a process snapshot and cut back on
restore; this one records what really ran, including work a restore redoes).
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--progress-log", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.progress_log:
            with open(args.progress_log, "a") as f:
                f.write(f"{os.getpid()} {step} {time.time():.3f}\n")
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    print(f"done: {args.steps} steps, final loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
