"""Batch inference with ``@task.cairn``: a retry resumes at the next shard, outputs exactly once.

The ``predict`` task runs a small fixed-seed torch model over ``shards`` input shards and
commits each shard's predictions to the store of the ``cairn_default`` connection (without
one: ``$AIRFLOW_HOME/cairn-store``) as ``outputs/<key path>/shard-00007.bin``, create-only.
The cursor (the next shard) is snapshotted after every shard. Kill the task mid-run (or set
``fail_after_shard`` to make try 1 fail after that shard): the retry starts at the next shard,
and a shard that a killed try committed just before dying is kept, not written twice. The
``check`` task reads the outputs back from the store: the hand-off to whatever comes next.

The shard logic is in ``workloads/batch_shards.py`` (loaded by path: not a DAG file). torch
is imported inside the task only, so the scheduler and dag-processor need no torch.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Param, dag, task

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "batch_shards.py"


def batch_shards() -> Any:
    """The ``workloads/batch_shards.py`` module, loaded once per process."""
    import importlib.util
    import sys

    name = "cairn_example_batch_shards"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, WORKLOAD)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[name]


@dag(
    dag_id="cairn_batch_inference",
    schedule=None,
    catchup=False,
    tags=["cairn", "example"],
    params={
        "shards": Param(20, type="integer", minimum=1),
        "shard_seconds": Param(
            0.0, type="number", minimum=0,
            description="sleep per shard, to make a demo run long enough to kill"),
        "fail_after_shard": Param(
            -1, type="integer", minimum=-1,
            description="try 1 fails once this shard is committed (-1: never)"),
    },
)
def cairn_batch_inference() -> None:
    @task.cairn(every_steps=1, retries=3, retry_delay=timedelta(seconds=5))
    def predict(ckpt, params=None, ti=None):
        fail_after = int(params["fail_after_shard"])
        return batch_shards().run_shards(
            ckpt, int(params["shards"]), shard_seconds=float(params["shard_seconds"]),
            crash_after=fail_after if fail_after >= 0 and ti.try_number == 1 else None)

    @task
    def check(result: dict):
        return batch_shards().check_outputs(result)

    check(predict())


cairn_batch_inference()
