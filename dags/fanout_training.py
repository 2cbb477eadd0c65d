"""Many small cooperative steps at once: one ``@task.cairn`` mapped over shards.

Each mapped task instance is a step of its own, with its own key (``map_index`` is part of
it), snapshots and retries, so on a multi-worker Airflow the shards run on whichever workers
have a free slot, and when a worker dies only its shards are retried, each resuming from its
own last snapshot (``make demo-cluster``, docs/distributed-airflow.md). A shard trains a
small MLP for ``total_steps`` steps, snapshotting every ``EVERY_STEPS``; with ``progress_dir``
it appends ``<pid> <step> <unix time>`` per step to ``<progress_dir>/<shard>.log``; with
``hold_file``, it waits before its last step for as long as that file exists (a test keeps
every shard running through an outage of any length that way).

torch is imported inside the task only.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, dag, task

EVERY_STEPS = 50


@dag(
    dag_id="cairn_fanout_training",
    schedule=None,
    catchup=False,
    tags=["cairn", "example"],
    params={
        "shards": Param(6, type="integer", minimum=1),
        "total_steps": Param(400, type="integer", minimum=1),
        "step_seconds": Param(0.0, type="number", minimum=0,
                              description="sleep per step, to make a demo run long enough to kill"),
        "progress_dir": Param("", type="string",
                              description="a directory for one '<shard>.log' progress file per shard"),
        "hold_file": Param("", type="string",
                           description="while this file exists, a shard waits before its last step"),
    },
)
def cairn_fanout_training() -> None:
    @task
    def shard_ids(params=None) -> list[int]:
        return list(range(int(params["shards"])))

    @task.cairn(every_steps=EVERY_STEPS, retries=3, retry_delay=timedelta(seconds=5))
    def train(ckpt, shard: int, params=None):
        import os
        import time

        import torch

        total, pause = int(params["total_steps"]), float(params["step_seconds"])
        hold = params["hold_file"]
        progress = (os.path.join(params["progress_dir"], f"{shard}.log")
                    if params["progress_dir"] else None)
        torch.manual_seed(shard)
        torch.set_num_threads(1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        start = ckpt.restore(model=model, optimizer=opt)
        for step in range(start, total):
            while hold and step == total - 1 and os.path.exists(hold):
                time.sleep(0.2)
            x = torch.randn(16, 8)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(step)
            if progress:
                with open(progress, "a") as f:
                    f.write(f"{os.getpid()} {step} {time.time():.3f}\n")
            if pause:
                time.sleep(pause)
        return {"shard": shard, "start_step": start, "end_step": total}

    train.expand(shard=shard_ids())


cairn_fanout_training()
