"""Cooperative torch training with ``@task.cairn``: a retry resumes from the last snapshot.

The task trains a small MLP on synthetic data and snapshots its model, optimizer and RNG state
every ``every_steps`` steps into the store of the ``cairn_default`` connection (without one:
``$AIRFLOW_HOME/cairn-store``). Kill the task's process mid-run (or let a node be preempted):
Airflow retries it, and the retry continues from the step after the last snapshot instead of
step 0. The task returns where it started and ended; the XCom ``cairn`` holds the snapshot
metadata.

torch is imported inside the task only, so the scheduler and dag-processor need no torch.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, dag, task

TOTAL_STEPS = 2000
EVERY_STEPS = 100


@dag(
    dag_id="cairn_cooperative_training",
    schedule=None,
    catchup=False,
    tags=["cairn", "example"],
    params={
        "total_steps": Param(TOTAL_STEPS, type="integer", minimum=1),
        "step_seconds": Param(0.0, type="number", minimum=0,
                              description="sleep per step, to make a demo run long enough to kill"),
        "progress_log": Param("", type="string",
                              description="a file to append '<pid> <step> <time>' to per step"),
    },
)
def cairn_cooperative_training() -> None:
    @task.cairn(every_steps=EVERY_STEPS, retries=3, retry_delay=timedelta(seconds=5))
    def train(ckpt, params=None):
        import os
        import time

        import torch

        total, pause = int(params["total_steps"]), float(params["step_seconds"])
        progress_log = params["progress_log"]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = ckpt.restore(model=model, optimizer=opt)
        print(f"cairn: starting at step {start} of {total}"
              + (f" (resumed from snapshot seq {ckpt.restored_from.seq})" if start else ""))
        loss = torch.tensor(float("nan"))
        for step in range(start, total):
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(step)
            if progress_log:
                with open(progress_log, "a") as f:
                    f.write(f"{os.getpid()} {step} {time.time():.3f}\n")
            if pause:
                time.sleep(pause)
        return {"start_step": start, "end_step": total, "loss": loss.item()}

    train()


cairn_cooperative_training()
