"""Rollback refused across workers (ADR 0049, :mod:`cairn_airflow.committed`), run by Airflow
(``dag.test()``, SQLite, the real task state store): try 1 trains and fails; before the retry
the worker's own committed-seq file is gone (the retry runs on another worker) and a bucket
writer deletes the newest snapshot. The retry learns the seq from Airflow's task state store
and refuses to begin older, without spending a retry; allowed, it resumes from the older one."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOTAL, EVERY, FAIL_AFTER = 30, 5, 20


def _key(dag_run):  # noqa: ANN001, ANN202
    from cairn.store import Key

    return Key((dag_run.dag_id, "train", dag_run.run_id, "-1"))


def _lose_newest_on_another_worker(context) -> None:  # noqa: ANN001 - Airflow's callback
    """Before the retry: this worker's committed-seq files are gone, as on a worker that never
    ran the task, and the newest snapshot is deleted from the store behind the task's back."""
    from cairn import open_store
    from cairn.store.slotlog import record_name
    from cairn_airflow.task_keys import task_key

    marks = os.environ["CAIRN_COMMITTED_DIR"]
    for name in os.listdir(marks):
        os.unlink(os.path.join(marks, name))
    key = task_key(context)
    with open_store(os.environ["TEST_STORE"]) as store:
        newest = store.snapshots(key)[0]
        store.raw_backend.delete(record_name(key.path, newest.seq))


def _training_dag(dag_id: str, *, allow_rollback: bool = False):  # noqa: ANN202 - a DAG
    from airflow.sdk import DAG, task

    with DAG(dag_id, schedule=None) as dag:
        @task.cairn(every_steps=EVERY, retries=2, retry_delay=timedelta(seconds=1),
                    on_retry_callback=_lose_newest_on_another_worker,
                    checkpointer_options={"allow_rollback": allow_rollback})
        def train(ckpt, ti=None):
            import torch

            model = torch.nn.Linear(4, 1)
            start = ckpt.restore(model=model)
            Path(os.environ["TEST_TRIES"], f"restored-{ti.try_number}").touch()
            for step in range(start, TOTAL):
                with torch.no_grad():
                    model.weight.add_(0.01)
                ckpt.step(step)
                if ti.try_number == 1 and step == FAIL_AFTER:
                    raise RuntimeError(f"simulated crash after step {step}")
            return {"start": start}

        train()
    return dag


@pytest.fixture()
def worker_env(tmp_path: Path, cairn_store: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's committed-seq directory, tries directory and store, in the environment."""
    monkeypatch.setenv("CAIRN_COMMITTED_DIR", str(tmp_path / "marks"))
    monkeypatch.setenv("TEST_STORE", str(cairn_store))
    tries = tmp_path / "tries"
    tries.mkdir()
    monkeypatch.setenv("TEST_TRIES", str(tries))
    return tries


def test_a_retry_on_another_worker_refuses_the_older_snapshot(airflow, cairn_store: Path,
                                                              worker_env: Path) -> None:
    from cairn import open_store
    from cairn.runtime.rollback import local_mark
    from cairn.store.slotlog import RecordKind
    from cairn_airflow.committed import SOURCE

    run = airflow.run(_training_dag("cairn_rollback_refused"))
    ti = airflow.task_instances(run)["train"]
    assert run.state == "failed" and ti.state == "failed"
    assert ti.try_number == 2, "the refusal spent no retry (retries=2)"
    assert sorted(os.listdir(worker_env)) == ["restored-1"], "try 2 restored nothing"
    key = _key(run)
    with open_store(str(cairn_store)) as store:
        opens = [r for r in store.history(key) if r.kind is RecordKind.OPEN]
        kept_newest = store.snapshots(key)[0].seq
    assert len(opens) == 1, "the refused try opened no attempt"
    mark = local_mark(str(cairn_store), str(key))
    assert mark.read() is not None and mark.read() > kept_newest
    assert mark.where().endswith(f"copied from {SOURCE}"), "the seq came from Airflow"


def test_allowed_the_retry_resumes_from_the_older_snapshot(airflow, worker_env: Path) -> None:
    run = airflow.run(_training_dag("cairn_rollback_allowed", allow_rollback=True))
    ti = airflow.task_instances(run)["train"]
    assert run.state == "success" and ti.try_number == 2
    assert sorted(os.listdir(worker_env)) == ["restored-1", "restored-2"]
    last_snapshot_step = (FAIL_AFTER + 1) // EVERY * EVERY - 1  # 19; the callback deleted it
    assert airflow.xcom(run, "train")["start"] == last_snapshot_step - EVERY + 1
