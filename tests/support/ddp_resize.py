"""A deterministic DDP or FSDP2 job (gloo, CPU) that keeps its global batch on any number of
ranks; run under torchrun, resumed by cairn's Checkpointer (resized when the world size
changed) or, with ``--from-dcp DIR``, by stock ``dcp.load`` from a ``cairn export --dcp`` copy
of the snapshot.

``torchrun --nproc_per_node=M -m tests.support.ddp_resize STORE KEY --total N --every K
[--fsdp] [--from-dcp DIR] [--no-resize] [--resize-lr RULE]`` prints ``start STEP`` (rank 0),
``restored RANK DIGEST``, ``rng RANK DIGEST`` and ``lr RANK HEX`` (every rank, right after the
restore: :func:`state_digest` of the model, optimizer and scheduler, :func:`rng_digest` of
torch's generator, the first param group's learning rate), ``loss STEP HEX`` (rank 0, its own
loss as ``float.hex``), ``committed STEP`` (rank 0) and ``final RANK DIGEST`` (every rank, at
the end). With ``--fsdp`` the model is ``fully_shard``-ed (uneven shards: 16 and 1 rows over 2
or 3 ranks) and the digests are of the whole tensors.
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
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):  # the whole tensor (a collective: every rank, same order)
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("--total", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--from-dcp", default=None, metavar="DIR")
    parser.add_argument("--no-resize", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--resize-lr", default="keep", choices=("keep", "linear", "sqrt"))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 8, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (module[0], module[2]):
            fully_shard(layer, mesh=mesh)
        model: Any = fully_shard(module, mesh=mesh)
    else:
        model = DistributedDataParallel(module)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    ckpt = None
    if args.from_dcp:
        step = _load_with_stock_dcp(args.from_dcp, model, opt, sched)
    else:
        from cairn.state import Checkpointer

        ckpt = Checkpointer(store=args.store, key=args.key, every_steps=args.every,
                            every_seconds=None, preemption=None, resize=not args.no_resize,
                            resize_lr=args.resize_lr)
        step = ckpt.restore(model=model, optimizer=opt, scheduler=sched)
    if rank == 0:
        say(f"start {step}")
    digest = state_digest(model.state_dict(), opt.state_dict(), sched.state_dict())
    say(f"restored {rank} {digest}")
    say(f"rng {rank} {rng_digest(torch.get_rng_state())}")
    say(f"lr {rank} {opt.param_groups[0]['lr'].hex()}")
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
    say(f"final {rank} {state_digest(model.state_dict(), opt.state_dict(), sched.state_dict())}")
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
