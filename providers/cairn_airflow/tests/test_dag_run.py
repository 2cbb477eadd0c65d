"""``@task.cairn`` run by Airflow (``dag.test()``, SQLite): training that resumes on retry."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOTAL, EVERY, FAIL_AFTER = 40, 5, 20


def _training_dag(dag_id: str, *, fail_first_try: bool = False,
                  sigterm_first_try_at: int | None = None):  # noqa: ANN202 - an Airflow DAG
    """Trains a tiny MLP for TOTAL steps; try 1 may crash after FAIL_AFTER, or get a SIGTERM
    (as from Airflow's kill or a node shutdown) during step ``sigterm_first_try_at``."""
    from airflow.sdk import DAG, task

    with DAG(dag_id, schedule=None) as dag:
        @task.cairn(every_steps=EVERY, retries=1, retry_delay=timedelta(seconds=1))
        def train(width: int, ckpt, ti=None):
            import os
            import signal

            import torch

            assert os.environ["CAIRN_KEY"] == str(ckpt.key)
            assert ckpt.store.url.endswith(os.environ["CAIRN_STORE"])
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                                        torch.nn.Linear(width, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            start = ckpt.restore(model=model, optimizer=opt)
            for step in range(start, TOTAL):
                x = torch.randn(16, 4)
                loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if ti.try_number == 1 and step == sigterm_first_try_at:
                    os.kill(os.getpid(), signal.SIGTERM)  # step() takes a final snapshot
                ckpt.step(step)
                if fail_first_try and ti.try_number == 1 and step == FAIL_AFTER:
                    raise RuntimeError(f"simulated crash after step {step}")
            return {"start": start, "try": ti.try_number, "loss": loss.item(),
                    "weight": model[0].weight.detach().flatten().tolist()[:4]}

        train(width=8)
    return dag


def _key(dag_run, task_id: str = "train"):  # noqa: ANN001, ANN202
    from cairn.store import Key

    return Key((dag_run.dag_id, task_id, dag_run.run_id, "-1"))


def test_training_task_succeeds_and_marks_the_key_done(airflow, cairn_store: Path,
                                                       one_thread: None) -> None:
    from cairn import open_store
    from cairn.store.slotlog import RecordKind

    run = airflow.run(_training_dag("cairn_train_ok"))
    assert run.state == "success"
    ti = airflow.task_instances(run)["train"]
    assert ti.state == "success" and ti.try_number == 1
    result = airflow.xcom(run, "train")
    assert result["start"] == 0 and result["try"] == 1
    meta = airflow.xcom(run, "train", key="cairn")
    assert meta["key"] == str(_key(run)) and meta["store"] == str(cairn_store)
    assert meta["step"] == TOTAL - 1 and meta["seq"] is not None
    assert meta["resumed_from"] is None and meta["done"] is True
    with open_store(str(cairn_store)) as store:
        history = store.history(_key(run))
        assert history[-1].kind is RecordKind.DONE and store.snapshots(_key(run)) == []


def test_retry_resumes_from_the_snapshot_of_the_failed_try(airflow, cairn_store: Path,
                                                            one_thread: None) -> None:
    from cairn import open_store
    from cairn.store.slotlog import RecordKind

    run = airflow.run(_training_dag("cairn_train_retry", fail_first_try=True))
    assert run.state == "success"
    ti = airflow.task_instances(run)["train"]
    assert ti.state == "success" and ti.try_number == 2
    result = airflow.xcom(run, "train")
    last_snapshot_step = (FAIL_AFTER + 1) // EVERY * EVERY - 1  # 19: snapshots after 4, 9, 14, 19
    assert result["try"] == 2 and result["start"] == last_snapshot_step + 1 > 0
    meta = airflow.xcom(run, "train", key="cairn")
    assert meta["try_number"] == 2 and meta["resumed_step"] == last_snapshot_step
    assert meta["resumed_from"] is not None and meta["step"] == TOTAL - 1 and meta["done"] is True
    with open_store(str(cairn_store)) as store:
        opens = [r for r in store.history(_key(run)) if r.kind is RecordKind.OPEN]
        assert len(opens) == 2  # one attempt per try, one key for both
        # Each try filed its outcome under its own epoch: the user error, then the success.
        failed, succeeded = store.records.outcomes(_key(run))
    assert [failed.epoch, succeeded.epoch] == [r.epoch for r in opens]
    assert failed.outcome.value == "failed" and "RuntimeError" in failed.detail["error"]
    assert failed.progress.kept_step == last_snapshot_step
    assert succeeded.outcome.value == "succeeded"
    assert succeeded.progress.start_step == last_snapshot_step + 1

    # Resuming is exact: the same weights as a run that never failed.
    clean = airflow.run(_training_dag("cairn_train_clean"))
    assert airflow.xcom(clean, "train")["weight"] == result["weight"]


def test_sigterm_takes_a_final_snapshot_and_the_retry_resumes_after_it(
        airflow, cairn_store: Path, one_thread: None) -> None:
    """SIGTERM in the task process: the next ``ckpt.step`` snapshots that step, hands the signal
    to Airflow's handler, and raises Preempted; the task fails, and its retry starts at the very
    next step (nothing redone)."""
    run = airflow.run(_training_dag("cairn_train_sigterm", sigterm_first_try_at=12))
    assert run.state == "success"
    assert airflow.task_instances(run)["train"].try_number == 2
    result = airflow.xcom(run, "train")
    assert result["try"] == 2 and result["start"] == 13
    meta = airflow.xcom(run, "train", key="cairn")
    assert meta["resumed_step"] == 12 and meta["done"] is True
    from cairn import open_store

    with open_store(str(cairn_store)) as store:
        kinds = [(o.outcome.value, o.progress.kept_step) for o in store.records.outcomes(_key(run))]
    assert kinds == [("preempted", 12), ("succeeded", TOTAL - 1)]


def test_example_cooperative_training_dag_runs(airflow, cairn_store: Path, one_thread: None) -> None:
    from airflow.dag_processing.dagbag import DagBag

    dags = Path(__file__).resolve().parents[3] / "dags"
    bag = DagBag(dag_folder=str(dags / "cooperative_training.py"))
    dag = bag.get_dag("cairn_cooperative_training")
    run = airflow.run(dag, run_conf={"total_steps": TOTAL})
    assert run.state == "success"
    assert airflow.xcom(run, "train")["end_step"] == TOTAL
    meta = airflow.xcom(run, "train", key="cairn")
    assert meta["done"] is True and meta["store"] == str(cairn_store)


def test_without_a_connection_the_store_is_under_airflow_home(airflow, airflow_home: Path) -> None:
    """No ``cairn_default``: ``$AIRFLOW_HOME/cairn-store``; a callable without ``ckpt`` still
    gets CAIRN_STORE/CAIRN_KEY for a subprocess, and torch is never needed."""
    from airflow.sdk import DAG, task

    with DAG("cairn_no_connection", schedule=None) as dag:
        @task.cairn(every_seconds=60)
        def launcher():
            import subprocess
            import sys

            code = "import os; print(os.environ['CAIRN_STORE'], os.environ['CAIRN_KEY'], os.environ['CAIRN_EVERY_SECONDS'])"
            return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True).stdout.split()

        launcher()

    run = airflow.run(dag)
    assert run.state == "success"
    store, key, every = airflow.xcom(run, "launcher")
    assert store == str(airflow_home / "cairn-store") and every == "60"
    assert key == f"cairn_no_connection/launcher/{run.run_id}/-1"
    meta = airflow.xcom(run, "launcher", key="cairn")
    assert meta["store"] == store and meta["seq"] is None and meta["done"] is True
