"""A DDP job (gloo, CPU) that reads a map-style dataset of indices through torchdata's
``StatefulDataLoader`` under a ``DistributedSampler``, resumed by cairn's Checkpointer, resized
when the world size changed; run under torchrun.

``torchrun --nproc_per_node=M -m tests.support.ddp_data_resize STORE KEY --length L --total N
--every K [--sampler torch|torchdata] [--workers W]`` prints ``start STEP EPOCH`` (rank 0),
``batch RANK STEP EPOCH I,J,...`` (every rank, each batch it trained on) and ``committed STEP``
(rank 0). The epoch is a named item, so a resumed run knows which epoch it is in.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from tests.support.ddp_resize import say

BATCH = 4
EPOCHS = 3


class Epoch:
    """The epoch the loop is in, as a Stateful item."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["epoch"])


def main() -> int:
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("key")
    parser.add_argument("--length", type=int, default=100)
    parser.add_argument("--total", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--sampler", choices=("torch", "torchdata"), default="torch")
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()

    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    from cairn.state import Checkpointer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = list(range(args.length))
    kind = StatefulDistributedSampler if args.sampler == "torchdata" else DistributedSampler
    sampler = kind(data, num_replicas=world, rank=rank, shuffle=True, seed=11)
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler,
                                num_workers=args.workers)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    epoch = Epoch()
    ckpt = Checkpointer(store=args.store, key=args.key, every_steps=args.every,
                        every_seconds=None, preemption=None)
    step = ckpt.restore(model=model, optimizer=opt, loader=loader, items={"epoch": epoch})
    if rank == 0:
        say(f"start {step} {epoch.value}")
    while epoch.value < EPOCHS and step < args.total:
        sampler.set_epoch(epoch.value)  # the same epoch a restore put back: its plan stands
        for batch in loader:
            x = batch.float().reshape(-1, 1)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            say(f"batch {rank} {step} {epoch.value} {','.join(map(str, batch.tolist()))}")
            committed = ckpt.committed_step
            ckpt.step(step)
            if rank == 0 and ckpt.committed_step != committed:
                say(f"committed {ckpt.committed_step}")
            step += 1
            if step >= args.total:
                break
        else:
            epoch.value += 1
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
