"""A suspended cairn task defers (``cairn_airflow.suspend``): in-process checks with
``dag.test()``, which runs the deferral's trigger inline, and the deferral's timeout.

The real-scheduler runs (triggerer, page API, both modes) are in test_scheduler_e2e.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

TOTAL, SUSPEND_AT = 30, 9


def _self_suspending_dag(dag_id: str, progress: Path):  # noqa: ANN202 - an Airflow DAG
    """Trains TOTAL steps; at step SUSPEND_AT of its first run it asks for its own suspension
    (as an operator would from the CLI) and resumes by itself 0.3 s after it (resume_after)."""
    from airflow.sdk import DAG, task

    with DAG(dag_id, schedule=None) as dag:
        @task.cairn(every_steps=1000, resume_after=0.3, resume_poll=0.05,
                    checkpointer_options={"suspend_poll_seconds": 0.05})
        def train(ckpt, ti=None):
            import os

            import torch

            from cairn.store import Key
            from cairn import open_store

            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            start = ckpt.restore(model=model, optimizer=opt)
            for step in range(start, TOTAL):
                opt.zero_grad()
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
                with open(progress, "a") as f:
                    f.write(f"{os.getpid()} {step} {ti.try_number}\n")
                if step == SUSPEND_AT and start == 0:
                    with open_store(os.environ["CAIRN_STORE"]) as store:
                        store.records.request_suspend(Key.parse(os.environ["CAIRN_KEY"]),
                                              by="test", reason="needs the GPU")
                    import time

                    time.sleep(0.2)  # past the poll interval: the next step() sees it
                ckpt.step(step)
            return {"start": start}

        train()
    return dag


@pytest.mark.slow
def test_a_suspended_task_defers_and_continues_after_resume_after(
        airflow, cairn_store: Path, tmp_path: Path, one_thread: None) -> None:
    from cairn.store import Key
    from cairn import open_store

    progress = tmp_path / "progress.log"
    run = airflow.run(_self_suspending_dag("cairn_self_suspend", progress))
    assert run.state == "success"
    ti = airflow.task_instances(run)["train"]
    assert ti.try_number == 1, "the suspension used a retry"
    rows = [line.split() for line in progress.read_text().splitlines()]
    assert [int(r[1]) for r in rows] == list(range(TOTAL)), "a step was redone or skipped"
    assert {r[2] for r in rows} == {"1"}
    # The step after the suspension ran in the continuation, which resumed from the snapshot.
    assert airflow.xcom(run, "train")["start"] == SUSPEND_AT + 1
    key = Key((run.dag_id, "train", run.run_id, "-1"))
    with open_store(str(cairn_store)) as store:
        outcomes = [o.outcome.value for o in store.records.outcomes(key)]
        requests = store.records.requests(key)
    assert outcomes == ["suspended", "succeeded"]
    assert [(r.kind.value, r.by) for r in requests] == [("suspend", "test"),
                                                       ("resume", "airflow (resume_after)")]


def _operator(**kwargs):  # noqa: ANN003, ANN202
    from cairn_airflow.operators import CairnPythonOperator

    return CairnPythonOperator(task_id="train", python_callable=lambda ckpt: None, **kwargs)


def _context(started: datetime | None) -> dict:
    return {"ti": SimpleNamespace(dag_id="d", task_id="train", run_id="r", map_index=-1,
                                  start_date=started)}


def test_the_deferral_timeout_is_what_is_left_of_execution_timeout() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from cairn_airflow.suspend import deferral_timeout

    now = datetime(2026, 12, 2, 1, 0, tzinfo=timezone.utc)
    assert deferral_timeout(_operator(), _context(now), now=now) is None
    op = _operator(execution_timeout=timedelta(hours=2))
    left = deferral_timeout(op, _context(now - timedelta(minutes=30)), now=now)
    assert left == timedelta(minutes=90)
    with pytest.raises(AirflowFailException, match="none of the task's execution_timeout"):
        deferral_timeout(op, _context(now - timedelta(hours=3)), now=now)


def test_a_deferral_that_timed_out_fails_without_a_retry_and_says_how_to_go_on(
        tmp_path: Path) -> None:
    from airflow.models.trigger import TriggerFailureReason
    from airflow.sdk.exceptions import AirflowFailException, TaskDeferralTimeout

    from cairn.store import Key
    from cairn import open_store

    url = str(tmp_path / "store")
    op = _operator(execution_timeout=timedelta(hours=1), store_url=url)
    timed_out = ("__fail__", {"error": TriggerFailureReason.TRIGGER_TIMEOUT}, _context(None))
    with open_store(url) as store:
        key = Key(("d", "train", "r", "-1"))
        store.open_attempt(key, note={"mode": "state"})
        # Not suspended: another deferral's timeout is Airflow's own error.
        with pytest.raises(TaskDeferralTimeout):
            op.resume_execution(*timed_out)
        store.records.request_suspend(key, by="tester")
    with pytest.raises(AirflowFailException) as caught:
        op.resume_execution(*timed_out)
    message = str(caught.value)
    assert "d/train/r/-1 stayed suspended" in message and "execution_timeout" in message
    assert "cairn resume" in message and "clear the task" in message


@pytest.mark.parametrize("value, seconds", [(None, None), (timedelta(minutes=2), 120.0),
                                            (30, 30.0), ("1h", 3600.0)])
def test_resume_after_takes_a_duration(value: object, seconds: float | None) -> None:
    assert _operator(resume_after=value).resume_after == seconds


def test_a_bad_resume_after_is_refused() -> None:
    from cairn.exceptions import ConfigError

    with pytest.raises(ConfigError):
        _operator(resume_after="soon")
