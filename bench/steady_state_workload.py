"""The training run that ``steady_state_bench.py`` times: a fine-tuning loop whose state is
about ``--bytes`` of which 10% changes at every step, with periodic snapshots by one side.

    python steady_state_workload.py --bytes N --steps S --side none|cairn|dcp_thread|dcp_process
        [--interval T] [--dir DIR] [--threads K] --result FILE

The model: a frozen embedding table (90% of the bytes, random values) looked up by each batch,
and a trainable two-layer MLP on top (10%), trained with plain SGD (no momentum, so the
optimizer keeps no state): every step rewrites the MLP's parameters and nothing else, so a
tenth of the state's bytes changes between any two snapshots. Each step is one forward and
backward pass of a 32-row batch; torch runs it on ``--threads`` threads (default: every core,
so snapshots compete with training for them).

Sides (``--interval T`` seconds between snapshots):

* ``none``: the steps alone;
* ``cairn``: ``Checkpointer(store=DIR/store, key=..., every_seconds=T)``, ``restore`` before
  the first step and ``step(i)`` after each (its defaults: a writer process at SCHED_IDLE
  persists; the training thread waits only for the copy into staging);
* ``dcp_thread``: every T seconds ``dcp.async_save`` of ``get_state_dict`` to a fresh
  ``FileSystemWriter`` directory, thread executor, one reused ``DefaultStager`` (the
  configuration with the lowest stall in ``state_bench``); the previous save is waited for
  before the next starts, and its directory removed once the next is durable;
* ``dcp_process``: the same with ``AsyncCheckpointerType.PROCESS`` and shared-memory staging.

The result file (JSON, written by a rename): ``steps_s`` (the step loop's own time,
``CLOCK_MONOTONIC``), ``steps``, ``snapshots`` (started inside the loop), ``state_bytes``,
``written_bytes`` (bytes a snapshot wrote: cairn's median over its snapshots after the
first, DCP's last checkpoint's directory), ``stall_s`` (the loop's time inside the
snapshotting calls: ``Checkpointer.step``, or ``async_save`` with the wait for the save before
it), ``setup_s`` and ``teardown_s``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn

BATCH = 32
DIM = 1024
TRAINABLE_SHARE = 0.10
FLOAT = 4


class FineTune(nn.Module):
    def __init__(self, nbytes: int) -> None:
        super().__init__()
        rows = max(1024, int(nbytes * (1 - TRAINABLE_SHARE)) // (DIM * FLOAT))
        hidden = max(64, int(nbytes * TRAINABLE_SHARE) // (2 * DIM * FLOAT))
        self.table = nn.Embedding(rows, DIM)
        self.table.weight.requires_grad_(False)
        self.up = nn.Linear(DIM, hidden, bias=False)
        self.down = nn.Linear(hidden, DIM, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.table(ids).mean(dim=1)
        return self.down(torch.relu(self.up(x)))


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def directory_bytes(path: str) -> int:
    total = 0
    for where, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(where, f)) for f in files)
    return total


class DcpSaver:
    """Periodic ``dcp.async_save`` as a DCP user would run it (module docstring)."""

    def __init__(self, root: str, *, process: bool) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root = root
        self.process = process
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=process, use_async_staging=False,
            use_non_blocking_copy=False))
        self.pending: Any = None
        self.pending_dir: str | None = None
        self.kept: str | None = None
        self.count = 0

    def _settle(self) -> None:
        if self.pending is None:
            return
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        pending, self.pending = self.pending, None
        if isinstance(pending, AsyncSaveResponse):
            pending.upload_completion.result()
        else:
            pending.result()
        if self.kept is not None:
            shutil.rmtree(self.kept)
        self.kept = self.pending_dir

    def save(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self._settle()
        msd, osd = get_state_dict(model, opt)
        self.count += 1
        self.pending_dir = os.path.join(self.root, f"step-{self.count}")
        kwargs: dict[str, Any] = {"async_stager": self.stager}
        if self.process:
            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        self.pending = dcp.async_save({"model": msd, "optim": osd},
                                      checkpoint_id=self.pending_dir, no_dist=True, **kwargs)

    def close(self) -> None:
        self._settle()
        self.stager.close()
        if self.process:  # the executor's process ends (and is reaped) when it is collected
            from torch.distributed.checkpoint import _async_process_executor as executor

            executor._CHECKPOINT_PROCESS = None
            gc.collect()


def note_commits(ckpt: Any, committed: dict[int, int]) -> None:
    """Record the snapshot the Checkpointer last saw commit: seq -> the bytes it wrote (the
    growth of ``bytes_written_total``, which counts every commit once)."""
    seq = ckpt.committed_seq
    if seq is not None and seq not in committed:
        committed[seq] = ckpt.bytes_written_total - sum(committed.values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--side", choices=("none", "cairn", "dcp_thread", "dcp_process"),
                   default="none")
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--dir", default=".")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    setup_start = time.monotonic()
    torch.manual_seed(0)
    model = FineTune(args.bytes)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    batches = [(torch.randint(0, model.table.num_embeddings, (BATCH, 16)),
                torch.randn(BATCH, DIM)) for _ in range(8)]
    ckpt: Any = None
    dcp_saver: DcpSaver | None = None
    if args.side == "cairn":
        from cairn import Checkpointer

        ckpt = Checkpointer(store=os.path.join(args.dir, "store"), key="bench/steady-state/run",
                            every_seconds=args.interval, preemption=None)
        ckpt.restore(model=model, optimizer=opt)
    elif args.side.startswith("dcp"):
        warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
        if args.side == "dcp_process":
            # DCP's PROCESS executor needs a default process group (it broadcasts its worker's
            # address); one rank, an in-process store, as state_bench runs it.
            import torch.distributed as dist

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dcp_saver = DcpSaver(os.path.join(args.dir, "dcp"), process=args.side == "dcp_process")
    setup_s = time.monotonic() - setup_start
    snapshots = 0
    stall_s = 0.0  # the loop's time inside the snapshotting calls
    committed: dict[int, int] = {}  # cairn's snapshots: seq -> bytes written
    start = time.monotonic()
    next_dcp = start + args.interval
    for step in range(args.steps):
        ids, target = batches[step % len(batches)]
        loss = nn.functional.mse_loss(model(ids), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if ckpt is not None:
            called = time.monotonic()
            snapshots += bool(ckpt.step(step))
            stall_s += time.monotonic() - called
            note_commits(ckpt, committed)
        elif dcp_saver is not None and time.monotonic() >= next_dcp:
            called = time.monotonic()
            dcp_saver.save(model, opt)
            stall_s += time.monotonic() - called
            snapshots += 1
            next_dcp = time.monotonic() + args.interval
    steps_s = time.monotonic() - start
    teardown_start = time.monotonic()
    written = 0
    if ckpt is not None:
        ckpt.wait()  # collects the writer's last reports
        note_commits(ckpt, committed)
        ckpt.close()
        sizes = [size for _, size in sorted(committed.items())[1:]]  # the first writes all
        written = int(statistics.median(sizes)) if sizes else 0
    elif dcp_saver is not None:
        dcp_saver.close()
        written = directory_bytes(dcp_saver.kept) if dcp_saver.kept else 0
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    result = {"steps_s": steps_s, "steps": args.steps, "snapshots": snapshots,
              "state_bytes": state_bytes(model), "written_bytes": written, "stall_s": stall_s,
              "setup_s": setup_s, "teardown_s": time.monotonic() - teardown_start}
    with open(args.result + ".tmp", "w", encoding="ascii") as f:
        json.dump(result, f)
    os.replace(args.result + ".tmp", args.result)


if __name__ == "__main__":
    main()
