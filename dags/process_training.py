"""Process-mode training with ``CairnRunOperator``: an unmodified script resumes on retry.

``workloads/train_mlp.py`` is an ordinary torch script. The operator runs it under
``cairn run``, which snapshots the whole process with CRIU every ``every`` seconds into the
store of the ``cairn_default`` connection (without one: ``$AIRFLOW_HOME/cairn-store``). Kill
the task mid-run: the retry restores the process from its last snapshot and it carries on,
without knowing. A SIGTERM (a node shutting down, a spot reclaim reaching the task) gets a
final snapshot, and the task is rescheduled without consuming one of its retries, up to
``max_preemptions`` times. Needs root and CRIU 4.x on the worker (``cairn doctor``).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

from airflow.sdk import Param, dag

from cairn_airflow.command import CairnRunOperator

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "train_mlp.py"


@dag(
    dag_id="cairn_process_training",
    schedule=None,
    catchup=False,
    tags=["cairn", "example"],
    params={
        "steps": Param(2000, type="integer", minimum=1),
        "step_seconds": Param(0.0, type="number", minimum=0,
                              description="sleep per step, to make a demo run long enough to kill"),
        "every": Param("10m", type="string", description="time between snapshots: 30s, 10m, 1h"),
        "progress_log": Param("", type="string",
                              description="a file the script appends '<pid> <step> <time>' to per step"),
    },
)
def cairn_process_training() -> None:
    CairnRunOperator(
        task_id="train",
        # The worker's own interpreter, which has torch; a container would name its python.
        command=[sys.executable, str(WORKLOAD), "--steps", "{{ params.steps }}",
                 "--step-seconds", "{{ params.step_seconds }}",
                 "--progress-log", "{{ params.progress_log or '' }}"],
        every="{{ params.every }}",
        grace=4,
        retries=3,
        retry_delay=timedelta(seconds=2),
        max_preemptions=3,  # spot-style: a preemption with a final snapshot is not a failure
    )


cairn_process_training()
