"""The example DAG ``dags/batch_inference.py``: each shard's output is committed exactly once,
across a failed try and its retry (``dag.test()``, SQLite)."""

from __future__ import annotations

import importlib.util
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import pytest

DAGS = Path(__file__).resolve().parents[3] / "dags"
SHARDS, FAIL_AFTER = 8, 3


def _shards_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("batch_shards_under_test",
                                                  DAGS / "workloads" / "batch_shards.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


bs = _shards_module()


def _expected(shards: int) -> list[bytes]:
    model = bs.build_model()
    return [bs.predict_shard(model, i) for i in range(shards)]


def _outputs(store_url: str) -> dict[str, bytes]:
    from cairn import open_store

    with open_store(store_url, create=False) as store:
        return {info.name: store.backend.read(info.name) for info in store.backend.list("outputs/")}


def test_the_output_format_round_trips(one_thread: None) -> None:
    import numpy as np

    data = bs.predict_shard(bs.build_model(), 7)
    header, payload = bs.decode(data)
    assert header == {"format": bs.FORMAT, "shard": 7, "dtype": "<f4",
                      "shape": [bs.ROWS, bs.OUT_FEATURES]}
    with pytest.raises(ValueError):
        bs.decode(data[:-1])
    import torch

    with torch.no_grad():
        direct = bs.build_model()(bs.shard_inputs(7)).numpy()
    assert np.array_equal(np.frombuffer(payload, dtype="<f4").reshape(direct.shape), direct)


def test_a_shard_committed_after_the_last_cursor_snapshot_is_reused(
        tmp_path: Path, one_thread: None) -> None:
    """The loop alone (no Airflow): try 1 is "killed" after committing shard 3 but before its
    cursor snapshot (shard 3 is committed by hand after a try that stopped at 2)."""
    from cairn.state.checkpointer import Checkpointer
    from cairn import open_store

    url, key = str(tmp_path / "store"), "dag/predict/run-1/-1"
    expected = _expected(6)
    with Checkpointer(store=url, key=key, every_steps=1) as ckpt:
        with pytest.raises(RuntimeError, match="after committing shard 2"):
            bs.run_shards(ckpt, 6, crash_after=2)
    name = bs.output_prefix(ckpt.key) + bs.shard_name(3)
    with open_store(url) as store:
        store.backend.create(name, expected[3])
        before = store.backend.stat(name)
    with Checkpointer(store=url, key=key, every_steps=1) as ckpt:
        result = bs.run_shards(ckpt, 6)
    assert {k: result[k] for k in ("shards", "written", "reused", "resumed_at")} == {
        "shards": 6, "written": 2, "reused": 1, "resumed_at": 3}
    outputs = _outputs(url)
    assert list(outputs) == result["outputs"] and list(outputs.values()) == expected
    with open_store(url) as store:
        assert store.backend.stat(name) == before  # kept, not written again
    assert bs.check_outputs(result) == {"shards": 6, "rows": 6 * bs.ROWS,
                                        "bytes": sum(map(len, expected))}


def _dag():  # noqa: ANN202 - an Airflow DAG
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS / "batch_inference.py"))
    assert not bag.import_errors, bag.import_errors
    return bag.get_dag("cairn_batch_inference")


@pytest.mark.slow
def test_retry_resumes_after_the_failed_shard_and_writes_each_once(
        airflow, cairn_store: Path, one_thread: None) -> None:
    run = airflow.run(_dag(), run_conf={"shards": SHARDS, "fail_after_shard": FAIL_AFTER})
    assert run.state == "success"
    tis = airflow.task_instances(run)
    assert tis["predict"].try_number == 2 and tis["check"].state == "success"
    result = airflow.xcom(run, "predict")
    assert result["resumed_at"] == FAIL_AFTER + 1 > 0
    # Try 1 wrote shards 0..FAIL_AFTER (FAIL_AFTER + 1 of them), the retry the rest.
    assert (FAIL_AFTER + 1) + result["written"] + result["reused"] == SHARDS
    assert result["reused"] == 0
    outputs = _outputs(str(cairn_store))
    assert list(outputs) == result["outputs"] and len(outputs) == SHARDS
    assert all(name.endswith(bs.shard_name(i)) for i, name in enumerate(outputs))
    assert list(outputs.values()) == _expected(SHARDS)
    expected_bytes = sum(map(len, outputs.values()))
    assert airflow.xcom(run, "check") == {"shards": SHARDS, "rows": SHARDS * bs.ROWS,
                                          "bytes": expected_bytes}
    meta = airflow.xcom(run, "predict", key="cairn")
    assert meta["resumed_step"] == FAIL_AFTER and meta["done"] is True


@pytest.mark.slow
def test_retry_reuses_a_shard_a_killed_try_committed_before_its_cursor_snapshot(
        airflow, cairn_store: Path, one_thread: None) -> None:
    """The next shard's object exists before the retry (as if try 1 committed it and was
    killed before snapshotting the cursor): the retry keeps it and counts it as reused."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.types import DagRunType

    from cairn.store import Key
    from cairn import open_store

    logical_date = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    run_id = DagRun.generate_run_id(run_type=DagRunType.MANUAL, logical_date=logical_date,
                                    run_after=logical_date)
    key = Key(("cairn_batch_inference", "predict", run_id, "-1"))
    expected = _expected(SHARDS)
    name = bs.output_prefix(key) + bs.shard_name(FAIL_AFTER + 1)
    with open_store(str(cairn_store)) as store:
        store.backend.create(name, expected[FAIL_AFTER + 1])
        before = store.backend.stat(name)

    run = airflow.run(_dag(), logical_date=logical_date, run_after=logical_date,
                      run_conf={"shards": SHARDS, "fail_after_shard": FAIL_AFTER})
    assert run.state == "success" and run.run_id == run_id
    assert airflow.task_instances(run)["predict"].try_number == 2
    result = airflow.xcom(run, "predict")
    assert result["resumed_at"] == FAIL_AFTER + 1
    assert result["reused"] == 1 and result["written"] == SHARDS - (FAIL_AFTER + 1) - 1
    outputs = _outputs(str(cairn_store))
    assert list(outputs) == result["outputs"] and list(outputs.values()) == expected
    with open_store(str(cairn_store)) as store:
        assert store.backend.stat(name) == before  # not rewritten
    assert airflow.xcom(run, "check")["shards"] == SHARDS
