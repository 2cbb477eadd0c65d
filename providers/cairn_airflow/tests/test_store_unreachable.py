"""A ``@task.cairn`` whose store cannot be reached fails its try before the callable runs,
with the error naming the store, and Airflow retries it as usual (ADR 0032)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_unreachable_store_fails_each_try_before_the_callable_runs(
        airflow, airflow_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk import DAG, task

    from cairn.runtime import env
    from cairn.store import Key
    from cairn import open_store
    from cairn_airflow.local_services import GcsServer

    server = GcsServer()  # a real bucket's stand-in, stopped: its port refuses connections
    server.start()
    server.create_bucket("gone")
    endpoint = server.url
    server.stop()
    url = "gs://gone/cairn"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    monkeypatch.setenv(env.STORE_CONNECT_TIMEOUT.name, "1s")
    ran, failures = tmp_path / "callable-ran", tmp_path / "failures.jsonl"

    def record_failure(context) -> None:  # noqa: ANN001 - Airflow's context
        with failures.open("a") as f:
            f.write(json.dumps({"try": context["ti"].try_number,
                                "error": f"{type(context['exception']).__name__}: "
                                         f"{context['exception']}"}) + "\n")

    with DAG("cairn_store_unreachable", schedule=None) as dag:
        @task.cairn(store_url=url, every_steps=1, retries=1, retry_delay=timedelta(seconds=1),
                    on_failure_callback=record_failure, on_retry_callback=record_failure)
        def train(ckpt):
            ran.write_text("the callable ran")

        train()

    run = airflow.run(dag)
    assert run.state == "failed"
    ti = airflow.task_instances(run)["train"]
    assert ti.state == "failed" and ti.try_number == 2  # try 1 was retried, as any failure
    assert not ran.exists()  # neither try began the workload
    seen = [json.loads(line) for line in failures.read_text().splitlines()]
    assert [s["try"] for s in seen] == [1, 2]
    for s in seen:
        assert s["error"].startswith(f"StoreUnreachable: cannot reach the store {url} at "
                                     f"{endpoint}: connection refused")
        assert "reachable from this worker" in s["error"]
    # Nothing was written anywhere else: not in the store Airflow uses without a connection.
    fallback = airflow_home / "cairn-store"
    if fallback.exists():
        with open_store(str(fallback), create=False) as store:
            assert Key(("cairn_store_unreachable", "train", run.run_id, "-1")) not in store.keys()
