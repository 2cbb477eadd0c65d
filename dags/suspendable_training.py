"""Suspend and resume a ``@task.cairn`` step: its GPUs are freed while it waits, no retry used.

Press **Suspend** on the task's cairn snapshots page (or run ``cairn suspend STORE KEY``):
at its next ``ckpt.step()`` the step takes a final snapshot and stops, and the task instance
goes ``deferred`` (its worker slot and GPU are free; the triggerer watches the store for a
resume). Press **Resume** (``cairn resume STORE KEY``): the task runs again on a worker, with
the same try number, and continues at the step after the suspend snapshot. The triggerer must
be running (``airflow standalone`` starts one).

Each step's side effect (a line ``<pid> <step> <unix time>`` in ``progress_log``) is written
before ``ckpt.step(step)``, which marks the step done: a suspend then redoes and skips nothing.
torch is imported inside the task only.
"""

from __future__ import annotations

from airflow.sdk import Param, dag, task


@dag(
    dag_id="cairn_suspendable_training",
    schedule=None,
    catchup=False,
    tags=["cairn", "example"],
    params={
        "total_steps": Param(2000, type="integer", minimum=1),
        "step_seconds": Param(0.05, type="number", minimum=0,
                              description="sleep per step, to leave time to press Suspend"),
        "progress_log": Param("", type="string",
                              description="a file to append '<pid> <step> <time>' to per step"),
    },
)
def cairn_suspendable_training() -> None:
    @task.cairn(every_steps=500, retries=1)
    def train(ckpt, params=None):
        import os
        import time

        import torch

        total, pause = int(params["total_steps"]), float(params["step_seconds"])
        progress_log = params["progress_log"]
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        start = ckpt.restore(model=model, optimizer=opt)
        print(f"cairn: starting at step {start} of {total}")
        loss = torch.tensor(float("nan"))
        for step in range(start, total):
            x = torch.randn(16, 8)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if progress_log:
                with open(progress_log, "a") as f:
                    f.write(f"{os.getpid()} {step} {time.time():.3f}\n")
            ckpt.step(step)  # may take the final snapshot of a suspend and stop here
            if pause:
                time.sleep(pause)
        return {"start_step": start, "end_step": total, "loss": loss.item()}

    train()


cairn_suspendable_training()
