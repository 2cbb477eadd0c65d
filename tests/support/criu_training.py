"""A deterministic torch training script that knows nothing of cairn (for ``cairn run`` tests).

DataLoader with two worker processes and shuffling, a metrics file opened in append mode,
progress on stdout. Writes the final weights' bytes to ``--out`` (raw, so the test compares
them bit for bit without unpickling anything).

    python criu_training.py --steps N --metrics FILE --out FILE [--sleep S]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    xs = torch.randn(512, 16)
    ys = (xs @ torch.randn(16, 1)).squeeze(1) + 0.1 * torch.randn(512)
    loader = DataLoader(TensorDataset(xs, ys), batch_size=32, shuffle=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0,
                        generator=torch.Generator().manual_seed(1))
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    with open(args.metrics, "a") as metrics:
        while step < args.steps:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x).squeeze(1), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                metrics.write(f"{step} {loss.item():.10f}\n")
                metrics.flush()
                print(f"step {step} loss {loss.item():.6f}", flush=True)
                step += 1
                if step >= args.steps:
                    break
                time.sleep(args.sleep)
    with open(args.out, "wb") as f:
        for p in model.parameters():
            f.write(p.detach().numpy().tobytes())
    print("done", flush=True)


if __name__ == "__main__":
    main()
