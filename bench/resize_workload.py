"""The torchrun script of ``resize_bench.py``: an FSDP2 model (gloo, CPU) with Adam, saved by 2
ranks, loaded on any number.

    torchrun --nproc_per_node=N resize_workload.py MODE --store URL --key KEY --dcp DIR
             --width D --layers L

``MODE`` is ``source`` (one training step, then the state saved twice: a cairn snapshot and
``dcp.save`` to ``DIR`` with ``FileSystemWriter``), ``cairn`` (``Checkpointer.restore``) or
``dcp`` (stock DCP's recipe: ``get_state_dict``, ``dcp.load`` from ``DIR``, ``set_state_dict``).
The model is built on the ``meta`` device and its pieces allocated after ``fully_shard``
(nothing initialised: the load overwrites it), the same on every mode. Rank 0 prints
``ready SECONDS LOAD_SECONDS`` (since the process started; the load call alone) once every rank
is ready to train, then ``digest HEX`` of the whole state (parameters and Adam's moments, the
whole tensors, BLAKE3), which must be the source's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

START = time.monotonic()  # before torch's import: the process's own work counts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build(width: int, layers: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False)
                                      for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer


def digest(model: Any, optimizer: Any) -> str | None:
    """BLAKE3 of the whole parameters and moments, in a fixed order (rank 0; a collective)."""
    import blake3

    h = blake3.blake3() if dist.get_rank() == 0 else None
    tensors = [p for p in model.parameters()]
    for index in range(len(tensors)):
        state = optimizer.state.get(tensors[index], {})
        tensors += [state[name] for name in ("exp_avg", "exp_avg_sq") if name in state]
    for tensor in tensors:
        whole = tensor.full_tensor()
        if h is not None:
            h.update(whole.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest() if h is not None else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("source", "cairn", "dcp"))
    parser.add_argument("--store", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--dcp", required=True)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, optimizer = build(args.width, args.layers)
    rank = dist.get_rank()
    load_s = 0.0
    if args.mode == "source":
        torch.manual_seed(rank)
        for p in model.parameters():
            p.data.to_local().normal_()  # a different piece on each rank: nothing dedups
        model(torch.randn(2, args.width)).sum().backward()
        optimizer.step()
        from cairn.state import Checkpointer

        ckpt = Checkpointer(store=args.store, key=args.key, every_steps=1, every_seconds=None,
                            preemption=None)
        ckpt.restore(model=model, optimizer=optimizer)
        ckpt.save(0, wait=True)
        ckpt.close()
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)  # DCP's recipe, as loaded
        dcp.save({"models": {"default": model_sd}, "optimizers": {"default": optim_sd}},
                 storage_writer=dcp.FileSystemWriter(args.dcp))
    elif args.mode == "cairn":
        from cairn.state import Checkpointer

        began = time.monotonic()
        ckpt = Checkpointer(store=args.store, key=args.key, every_steps=1000,
                            every_seconds=None, preemption=None)
        ckpt.restore(model=model, optimizer=optimizer)
        load_s = time.monotonic() - began
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        began = time.monotonic()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"models": {"default": model_sd}, "optimizers": {"default": optim_sd}}
        dcp.load(state, storage_reader=dcp.FileSystemReader(args.dcp))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        load_s = time.monotonic() - began
    dist.barrier()
    if rank == 0:
        print(f"ready {time.monotonic() - START:.4f} {load_s:.4f}", flush=True)
    found = digest(model, optimizer)
    if rank == 0:
        print(f"digest {found}", flush=True)
    if args.mode == "cairn":
        ckpt.close()
    dist.barrier()
    # Every figure is out: leave without the interpreter's teardown, where gloo's and DCP's
    # threads once aborted a 3-rank run ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
