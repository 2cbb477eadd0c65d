"""A deterministic DDP job (gloo, CPU) that keeps its global batch on any number of ranks; run
under torchrun, resumed by cairn's Checkpointer (resized when the world size changed) or, with
``--from-dcp DIR``, by stock ``dcp.load`` from a ``cairn export --dcp`` copy of the snapshot.

``torchrun --nproc_per_node=M -m tests.support.ddp_resize STORE KEY --total N --every K
[--from-dcp DIR] [--no-resize]`` prints ``start STEP`` (rank 0), ``restored RANK DIGEST`` and
``rng RANK DIGEST`` (every rank, right after the restore: :func:`state_digest` of the model,
optimizer and scheduler, :func:`rng_digest` of torch's generator), ``loss STEP HEX`` (rank 0,
its own loss as ``float.hex``) and ``committed STEP`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import blake3
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4 and 6 ranks


def state_digest(model: dict[str, Any], optimizer: dict[str, Any],
                 scheduler: dict[str, Any]) -> str:
    """BLAKE3 of every tensor's bytes (model, then optimizer state, in key order) and of the
    param groups and scheduler state as JSON: equal digests, equal state bit for bit."""
    h = blake3.blake3()
    for name in sorted(model):
        h.update(name.encode() + _bytes(model[name]))
    for index in sorted(optimizer["state"], key=int):
        for name in sorted(optimizer["state"][index]):
            h.update(f"{index}.{name}".encode() + _bytes(optimizer["state"][index][name]))
    h.update(json.dumps(optimizer["param_groups"], sort_keys=True).encode())
    h.update(json.dumps(scheduler, sort_keys=True, default=str).encode())
    return h.hexdigest()


def say(line: str) -> None:
    """One line in one write: the ranks share torchrun's stdout pipe, and a write of less than
    PIPE_BUF bytes is never interleaved with another."""
    os.write(1, (line + "\n").encode())


def rng_digest(state: torch.Tensor) -> str:
    return blake3.blake3(_bytes(state)).hexdigest()


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("--total", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--from-dcp", default=None, metavar="DIR")
    parser.add_argument("--no-resize", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 8, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    ckpt = None
    if args.from_dcp:
        step = _load_with_stock_dcp(args.from_dcp, model, opt, sched)
    else:
        from cairn.state import Checkpointer

        ckpt = Checkpointer(store=args.store, key=args.key, every_steps=args.every,
                            every_seconds=None, preemption=None, resize=not args.no_resize)
        step = ckpt.restore(model=model, optimizer=opt, scheduler=sched)
    if rank == 0:
        say(f"start {step}")
    digest = state_digest(model.state_dict(), opt.state_dict(), sched.state_dict())
    say(f"restored {rank} {digest}")
    say(f"rng {rank} {rng_digest(torch.get_rng_state())}")
    per_rank = GLOBAL_BATCH // world  # the global batch kept: the script's part of a resize
    while step < args.total:
        rows = [(step * GLOBAL_BATCH + rank * per_rank + i) % len(x) for i in range(per_rank)]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        committed = ckpt.committed_step if ckpt is not None else None
        if ckpt is not None:
            ckpt.step(step)
        if rank == 0:
            say(f"loss {step} {loss.item().hex()}")
            if ckpt is not None and ckpt.committed_step != committed:
                say(f"committed {ckpt.committed_step}")
        step += 1
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()
    return 0


def _load_with_stock_dcp(path: str, model: Any, opt: Any, sched: Any) -> int:
    """What a user who left cairn runs: the optimizer's state made (a step with zero
    gradients, which moves no weight with Adam), then DCP's own reader and planner."""
    import torch.distributed.checkpoint as dcp

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = [group["lr"] for group in opt.param_groups]
    opt.step()
    opt.zero_grad()
    assert lr == [group["lr"] for group in opt.param_groups]
    state = {"models": {"default": model.state_dict()},
             "optimizers": {"default": opt.state_dict()},
             "schedulers": {"default": sched.state_dict()}, "step": 0}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["models"]["default"])
    opt.load_state_dict(state["optimizers"]["default"])
    sched.load_state_dict(state["schedulers"]["default"])
    return int(state["step"]) + 1


if __name__ == "__main__":
    sys.exit(main())
