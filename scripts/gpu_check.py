"""GPU check for state mode, to run where a CUDA device is lent (no GPU on the dev machines).

    python scripts/gpu_check.py [--params 124e6]

Builds a model on the GPU with Adam state, snapshots it through the Checkpointer (pinned
staging buffer, side-stream copy), restores into a fresh GPU model, checks every tensor is
bit-identical, and prints the stall against the state's bytes over the measured pinned
device-to-host bandwidth. Exits non-zero on any mismatch. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from cairn.state import Checkpointer


def build(params: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 2048
    layers = max(1, int(params // (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, width, device=device)).sum().backward()
    opt.step()
    return model, opt


def pinned_d2h_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=124e6)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    model, opt = build(args.params, "cuda")
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(t.numel() * t.element_size() for s in opt.state.values()
                       for t in s.values() if torch.is_tensor(t))
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        ckpt = Checkpointer(store=f"{root}/store", key="gpu/check/run/0", preemption=None)
        ckpt.restore(model=model, optimizer=opt)
        stalls = []
        for step in range(args.runs + 1):
            ckpt.save(step)
            stalls.append(ckpt.last_stall_s or 0.0)
            ckpt.wait()
        ckpt.close()
        fresh, fresh_opt = build(args.params, "cuda")
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(1.0)
        again = Checkpointer(store=f"{root}/store", key="gpu/check/run/0", preemption=None)
        next_step = again.restore(model=fresh, optimizer=fresh_opt)
        again.close()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 fresh.state_dict().values()))
    gbps = pinned_d2h_gbps(min(state_bytes, 2 << 30))
    floor = state_bytes / (gbps * 1e9)
    median = statistics.median(stalls[1:])
    result = {"device": torch.cuda.get_device_name(), "state_bytes": state_bytes,
              "first_stall_s": round(stalls[0], 4), "median_stall_s": round(median, 4),
              "pinned_d2h_gbps": round(gbps, 2), "floor_s": round(floor, 4),
              "stall_vs_d2h_floor": round(median / floor, 2), "restored_next_step": next_step,
              "bit_identical": same}
    print(f"stall {median:.3f}s for {state_bytes / 1e9:.2f} GB; pinned D2H {gbps:.1f} GB/s "
          f"-> floor {floor:.3f}s; ratio {median / floor:.2f}; restored bit-identical: {same}")
    print(json.dumps(result))
    return 0 if same and next_step == args.runs + 1 else 1


if __name__ == "__main__":
    sys.exit(main())
