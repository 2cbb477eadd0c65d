"""A restore that fails on the worker's side (an injected library failure, as cryptography
51's ``ValueError: data and buf must not overlap`` was) fails the task with
``AirflowFailException``: no retry is spent on it, no snapshot is skipped, and every snapshot
restores once the cause is gone (issue 32 item 4). Run by Airflow (``dag.test()``, SQLite).

The injection is the main suite's ``tests/support/read_failure.py``, loaded by its path (this
suite's tests are not on the path of the repository's)."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
TOTAL, EVERY = 20, 5


def read_failure() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cairn_test_read_failure", REPO / "tests" / "support" / "read_failure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _dag(dag_id: str, inject: Any):  # noqa: ANN202 - an Airflow DAG
    """Try 1 snapshots after steps 4 and 9 and crashes after 12; try 2 meets the injected
    failure in ``ckpt.restore`` (``inject()`` just before it)."""
    from airflow.sdk import DAG, task

    with DAG(dag_id, schedule=None) as dag:
        @task.cairn(every_steps=EVERY, retries=3, retry_delay=timedelta(seconds=1))
        def train(ckpt, ti=None):
            import torch

            model, opt = _model()
            if ti.try_number == 2:
                inject()
            start = ckpt.restore(model=model, optimizer=opt)
            for step in range(start, TOTAL):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step(step)
                if ti.try_number == 1 and step == 12:
                    raise RuntimeError(f"simulated crash after step {step}")
            return {"start": start, "try": ti.try_number}

        train()
    return dag


@pytest.mark.slow
def test_a_restore_failing_on_the_worker_fails_the_task_without_a_retry(
        airflow, cairn_store: Path, one_thread: None) -> None:
    from cairn.state import Checkpointer
    from cairn.store import Key
    from cairn import open_store
    from cairn.store.outcomes import OutcomeKind

    helper = read_failure()
    undo: list[Any] = []
    run = airflow.run(_dag("cairn_restore_failure", lambda: undo.append(helper.install("part"))))
    for step in undo:
        step()  # the injection is gone from here on
    assert undo, "try 2 ran and injected the failure"

    assert run.state == "failed"  # a skip to an older snapshot, or to step 0, would succeed
    ti = airflow.task_instances(run)["train"]
    assert ti.state == "failed" and ti.try_number == 2, "retries=3, yet no try 3"
    key = Key(("cairn_restore_failure", "train", run.run_id, "-1"))
    with open_store(str(cairn_store)) as store:
        outcomes = store.records.outcomes(key)
        assert [o.outcome for o in outcomes] == [OutcomeKind.FAILED, OutcomeKind.FAILED]
        assert f"ValueError: {helper.INJECTED}" in outcomes[1].detail["error"]
        assert "RestoreFailed" in outcomes[1].detail["error"]
        assert [info.manifest.step for info in store.snapshots(key)] == [9, 4]
        assert store.verify(key).ok
        model, opt = _model()
        ckpt = Checkpointer(store=store, key=key, preemption=None)
        assert ckpt.restore(model=model, optimizer=opt) == 10  # the newest, once fixed
        ckpt.close()


def test_the_verdict_of_a_restore_failure_is_no_retry() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from cairn import ResumePolicy, Try
    from cairn.exceptions import RestoreFailed
    from cairn.policy.history import History
    from cairn.store import Key
    from cairn_airflow.command import exit_error
    from cairn_airflow.resume import raise_verdict, refuse_restore_failure

    this_try = Try(store="/nowhere", key=Key(("d", "t", "r", "-1")), policy=ResumePolicy(),
                   history=History())
    error = RestoreFailed("reading snapshot seq 3 failed on this side", seq=3)
    with pytest.raises(AirflowFailException, match="Not retrying") as caught:
        raise_verdict(this_try, this_try.ended(error=error), error, delay=None)
    assert caught.value.__cause__ is error
    refuse_restore_failure(RuntimeError("the step's own error"))  # anything else: no verdict
    # CairnRunOperator's view of `cairn run` refusing a rollback (exit 9): no retry either.
    refused = exit_error(9, this_try.key)
    with pytest.raises(AirflowFailException, match="refused to begin.*Not retrying"):
        raise_verdict(this_try, this_try.ended(error=refused), refused, delay=None)
    assert "exited with 2" in str(exit_error(2, this_try.key))  # bad input: Airflow's retry
