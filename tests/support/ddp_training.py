"""A deterministic 2-rank DDP job (gloo, CPU) with cairn's Checkpointer; run under torchrun.

``torchrun --nproc_per_node=2 -m tests.support.ddp_training STORE KEY OUT --total N --every K``
prints, on rank 0, ``start STEP``, ``loss STEP VALUE`` per step and ``committed STEP`` when a
snapshot is durable; rank 0 writes the final weights to OUT.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from cairn.state import Checkpointer
from tests.support.script_common import arguments


def main() -> int:
    args = arguments().parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = StatefulDataLoader(data, batch_size=8, sampler=sampler, num_workers=0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                        torch.nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(store=args.store, key=args.key, every_steps=args.every,
                        every_seconds=None, preemption=None)
    step = ckpt.restore(model=model, optimizer=opt, loader=loader)
    if rank == 0:
        print(f"start {step}", flush=True)
    batches = iter(loader)
    while step < args.total:
        xb, yb = next(batches)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        committed = ckpt.committed_step
        ckpt.step(step)
        if rank == 0:
            print(f"loss {step} {loss.item():.10f}", flush=True)
            if ckpt.committed_step != committed:
                print(f"committed {ckpt.committed_step}", flush=True)
        step += 1
    ckpt.close()
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
