"""The operators' resume policy run by Airflow (``dag.test()``, SQLite): errors versus
preemptions, the crash-loop stop, the loop guard, and a preemption that does not consume a
retry."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TOTAL, EVERY = 20, 5


def _dag(dag_id: str, *, retries: int, crash_on_try: dict[int, int] | None = None,
         poison_start: int | None = None, sigterm_on_try_1_at: int | None = None,
         **cairn_options: Any):  # noqa: ANN202 - an Airflow DAG
    """A tiny training task (snapshots every EVERY steps). ``crash_on_try``: try -> the step
    after which it raises; ``poison_start``: every try that resumes at that step raises at once
    (a snapshot whose state crashes the step); ``sigterm_on_try_1_at``: try 1 gets SIGTERM
    during that step, as from a node shutdown."""
    from airflow.sdk import DAG, task

    crashes = dict(crash_on_try or {})

    with DAG(dag_id, schedule=None) as dag:
        @task.cairn(every_steps=EVERY, retries=retries, retry_delay=timedelta(seconds=1),
                    **cairn_options)
        def train(ckpt, ti=None):
            import os
            import signal

            import torch

            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            start = ckpt.restore(model=model, optimizer=opt)
            if poison_start is not None and start == poison_start:
                raise RuntimeError(f"poisoned state at step {start}")
            for step in range(start, TOTAL):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if ti.try_number == 1 and step == sigterm_on_try_1_at:
                    os.kill(os.getpid(), signal.SIGTERM)
                ckpt.step(step)
                if crashes.get(ti.try_number) == step:
                    raise RuntimeError(f"simulated crash after step {step}")
            return {"start": start, "try": ti.try_number}

        train()
    return dag


def _outcomes(store: Path, run: Any) -> list[str]:
    from cairn.store import Key
    from cairn import open_store

    with open_store(str(store)) as s:
        return [o.outcome.value for o in s.records.outcomes(Key((run.dag_id, "train", run.run_id, "-1")))]


def test_max_error_retries_stops_a_crash_loop_before_retries_run_out(
        airflow, cairn_store: Path, one_thread: None) -> None:
    run = airflow.run(_dag("cairn_policy_crash_loop", retries=5, max_error_retries=1,
                           crash_on_try={1: 7, 2: 12, 3: 17, 4: 17, 5: 17, 6: 17}))
    assert run.state == "failed"
    ti = airflow.task_instances(run)["train"]
    # Try 2's error is the second: more than max_error_retries=1, so no try 3 of the 6 allowed.
    assert ti.state == "failed" and ti.try_number == 2
    assert _outcomes(cairn_store, run) == ["failed", "failed"]


def test_resume_on_preemption_starts_fresh_after_the_steps_own_error(
        airflow, cairn_store: Path, one_thread: None) -> None:
    run = airflow.run(_dag("cairn_policy_fresh", retries=1, resume_on="preemption",
                           crash_on_try={1: 12}))
    assert run.state == "success"
    assert airflow.xcom(run, "train") == {"start": 0, "try": 2}
    meta = airflow.xcom(run, "train", key="cairn")
    assert meta["resumed_from"] is None and "resume_on=preemption" in meta["resume_plan"]
    # The default resumes after an error (test_dag_run.py checks where); here, the contrast:
    run = airflow.run(_dag("cairn_policy_resume", retries=1, crash_on_try={1: 12}))
    assert airflow.xcom(run, "train") == {"start": 10, "try": 2}


def test_the_loop_guard_falls_back_past_a_snapshot_two_tries_died_on(
        airflow, cairn_store: Path, one_thread: None) -> None:
    # Try 1 snapshots after steps 4 and 9 and crashes after 12. Tries 2 and 3 resume at 10
    # and die at once; try 4 falls back to the snapshot of step 4 and finishes.
    run = airflow.run(_dag("cairn_policy_loop", retries=3, crash_on_try={1: 12},
                           poison_start=10))
    assert run.state == "success"
    assert airflow.xcom(run, "train") == {"start": 5, "try": 4}
    meta = airflow.xcom(run, "train", key="cairn")
    assert "loop guard: two tries resumed from seq" in meta["resume_plan"]
    assert meta["resumed_step"] == 4
    assert _outcomes(cairn_store, run) == ["failed", "failed", "failed", "succeeded"]
    # Without the guard, every retry dies on the same snapshot.
    run = airflow.run(_dag("cairn_policy_no_guard", retries=3, crash_on_try={1: 12},
                           poison_start=10, loop_guard=False))
    assert run.state == "failed"


def test_a_preemption_reschedules_without_consuming_a_retry(
        airflow, cairn_store: Path, one_thread: None) -> None:
    run = airflow.run(_dag("cairn_policy_reschedule", retries=0, max_preemptions=1,
                           sigterm_on_try_1_at=12))
    assert run.state == "success"
    ti = airflow.task_instances(run)["train"]
    assert ti.try_number == 1  # retries=0: only a reschedule could have run it again
    assert airflow.xcom(run, "train") == {"start": 13, "try": 1}
    assert _outcomes(cairn_store, run) == ["preempted", "succeeded"]


def test_the_outcome_is_in_the_store_before_airflow_is_told(
        airflow, cairn_store: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each try's outcome record is written before the operator's first call to Airflow's
    API (the ``cairn`` XCom): in a metadata-database outage that call waits until the task is
    killed, and a try killed then left no record (issue 34)."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    seen: list[list[str]] = []
    original = RuntimeTaskInstance.xcom_push

    def xcom_push(self: Any, key: str, value: Any) -> None:
        if key == "cairn":
            run = type("Run", (), {"dag_id": self.dag_id, "run_id": self.run_id})
            seen.append(_outcomes(cairn_store, run))
        original(self, key, value)

    monkeypatch.setattr(RuntimeTaskInstance, "xcom_push", xcom_push)
    run = airflow.run(_dag("cairn_policy_outcome_first", retries=0, max_preemptions=1,
                           sigterm_on_try_1_at=12))
    assert run.state == "success"
    assert seen == [["preempted"], ["preempted", "succeeded"]]


def test_a_skip_is_neither_an_error_nor_an_outcome(airflow, cairn_store: Path,
                                                  one_thread: None) -> None:
    """AirflowSkipException raised by the callable passes through: the task is skipped, even
    with max_error_retries=0, and no failure is recorded against the step."""
    from airflow.sdk import DAG, task

    with DAG("cairn_policy_skip", schedule=None) as dag:
        @task.cairn(every_steps=EVERY, retries=2, max_error_retries=0)
        def train(ckpt):
            from airflow.sdk.exceptions import AirflowSkipException

            ckpt.restore()
            raise AirflowSkipException("nothing to train today")

        train()

    run = airflow.run(dag)
    assert airflow.task_instances(run)["train"].state == "skipped"
    assert _outcomes(cairn_store, run) == []
