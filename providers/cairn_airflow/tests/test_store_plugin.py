"""The Airflow provider on a store backend it does not know: the toy store (``toy://``), a
test-only distribution (``tests/support/toy_store``) that ``make test`` installs into this
environment and that reaches cairn only through the ``cairn.stores`` entry point. Its
connection field, the connection form, and a ``@task.cairn`` training task that fails and
resumes from the toy store, with the store's root given by the connection alone."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from airflow.sdk import Connection

from cairn.exceptions import ConfigError
from cairn_airflow import get_provider_info
from cairn_airflow.hooks import store_config_from_connection

TOTAL, EVERY, FAIL_AFTER = 30, 5, 17


def _conn(host: str, **extra: object) -> Connection:
    return Connection(conn_id="cairn_default", conn_type="cairn", host=host,
                      extra=json.dumps(extra) if extra else None)


def test_the_toy_kinds_connection_field_sets_its_variable() -> None:
    config = store_config_from_connection(_conn("toy://bucket/p", toy_root="/srv/toy"))
    assert config.url == "toy://bucket/p" and config.env == {"CAIRN_TOY_STORE_ROOT": "/srv/toy"}
    with pytest.raises(ConfigError, match="toy_root is set but the store 'gs://b/p' is not on "
                                          "the toy store"):
        store_config_from_connection(_conn("gs://b/p", toy_root="/srv/toy"))
    with pytest.raises(ConfigError, match="gcs_keyfile_path is set but the store "
                                          "'toy://bucket/p' is not on Google Cloud Storage"):
        store_config_from_connection(_conn("toy://bucket/p", gcs_keyfile_path="/k.json"))


def test_the_connection_form_has_every_installed_kinds_fields() -> None:
    (connection,) = get_provider_info()["connection-types"]
    fields = connection["conn-fields"]
    assert set(fields) == {"store_url", "gcs_keyfile_path", "s3_endpoint_url", "s3_region",
                           "s3_profile", "toy_root"}
    assert fields["toy_root"]["label"] == "Toy store root"
    assert "toy://BUCKET/PREFIX" in connection["ui-field-behaviour"]["placeholders"]["host"]


def _training_dag(dag_id: str):  # noqa: ANN202 - an Airflow DAG
    from airflow.sdk import DAG, task

    with DAG(dag_id, schedule=None) as dag:
        @task.cairn(every_steps=EVERY, retries=1, retry_delay=timedelta(seconds=1))
        def train(ckpt, ti=None):
            import torch

            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            start = ckpt.restore(model=model, optimizer=opt)
            for step in range(start, TOTAL):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step(step)
                if ti.try_number == 1 and step == FAIL_AFTER:
                    raise RuntimeError(f"simulated crash after step {step}")
            return {"start": start, "try": ti.try_number, "store": ckpt.store.url}

        train()
    return dag


@pytest.mark.slow
def test_a_task_resumes_from_the_toy_store(airflow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           one_thread: None) -> None:
    root = tmp_path / "toy-root"
    monkeypatch.delenv("CAIRN_TOY_STORE_ROOT", raising=False)  # only the connection names it
    monkeypatch.setenv("AIRFLOW_CONN_CAIRN_DEFAULT", json.dumps({
        "conn_type": "cairn", "extra": {"store_url": "toy://bucket/airflow",
                                        "toy_root": str(root)}}))
    run = airflow.run(_training_dag("cairn_toy_store_resume"))
    assert run.state == "success"
    assert airflow.task_instances(run)["train"].try_number == 2
    result = airflow.xcom(run, "train")
    last_snapshot_step = (FAIL_AFTER + 1) // EVERY * EVERY - 1
    assert result == {"start": last_snapshot_step + 1, "try": 2, "store": "toy://bucket/airflow"}
    assert "CAIRN_TOY_STORE_ROOT" not in os.environ
    from cairn.store import Key
    from cairn import open_store

    monkeypatch.setenv("CAIRN_TOY_STORE_ROOT", str(root))
    with open_store("toy://bucket/airflow", create=False) as store:
        outcomes = store.records.outcomes(Key((run.dag_id, "train", run.run_id, "-1")))
    assert [o.outcome.value for o in outcomes] == ["failed", "succeeded"]
    assert any(root.glob("bucket/*"))
