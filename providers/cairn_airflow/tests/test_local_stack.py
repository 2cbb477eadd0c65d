"""``AirflowStack``'s executor option and the worker nodes, as configured (nothing started:
the cluster itself runs in test_celery_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.exceptions import ConfigError
from cairn_airflow.local_nodes import WorkerNode
from cairn_airflow.local_stack import AirflowStack, Executor, commits_after

DAGS = Path(__file__).resolve().parents[3] / "dags"


def test_the_local_executor_is_the_default_and_starts_no_servers_or_nodes(tmp_path: Path) -> None:
    stack = AirflowStack(tmp_path / "home", DAGS, store=tmp_path / "store")
    assert stack.executor is Executor.LOCAL
    assert stack.env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert stack.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("sqlite:///")
    assert stack.services == [] and stack.nodes == {}
    assert not any(name.startswith("AIRFLOW__CELERY") for name in stack.env)


def test_a_celery_cluster_refuses_a_store_its_nodes_do_not_share(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"must be a bucket every node reaches \(gs://BUCKET/PREFIX"):
        AirflowStack(tmp_path / "home", DAGS, store=tmp_path / "store", executor="celery")


def test_an_unknown_executor_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use one of local, celery"):
        AirflowStack(tmp_path / "home", DAGS, store=tmp_path / "store", executor="kubernetes")


def test_node_names_must_be_distinct(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="distinct names"):
        AirflowStack(tmp_path / "home", DAGS, store="gs://b/p", executor="celery",
                     nodes=("nodeA", "nodeA"))


def test_a_celery_cluster_retries_through_the_heartbeat_not_the_broker(tmp_path: Path) -> None:
    stack = AirflowStack(tmp_path / "home", DAGS, store="gs://bucket/prefix",
                         executor=Executor.CELERY, env={"STORAGE_EMULATOR_HOST": "http://x:1"})
    env = stack.env
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == stack.postgres.url
    assert env["AIRFLOW__CELERY__BROKER_URL"] == stack.redis.url
    # The broker would hand a dead worker's task to another only after this; the scheduler's
    # heartbeat timeout is far shorter.
    visibility = int(env["AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT"])
    assert visibility > 100 * int(env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"])
    assert list(stack.nodes) == ["nodeA", "nodeB"]


def test_a_celery_worker_keeps_its_running_tasks_when_the_broker_goes_away(
        tmp_path: Path) -> None:
    import json

    stack = AirflowStack(tmp_path / "home", DAGS, store="gs://bucket/prefix",
                         executor=Executor.CELERY)
    extra = json.loads(stack.env["AIRFLOW__CELERY__EXTRA_CELERY_CONFIG"])
    assert extra == {"worker_cancel_long_running_tasks_on_connection_loss": False}


def test_each_node_sees_its_local_disk_at_the_one_path_and_gets_the_cluster_env(
        tmp_path: Path) -> None:
    stack = AirflowStack(tmp_path / "home", DAGS, store="gs://bucket/prefix",
                         executor=Executor.CELERY, env={"STORAGE_EMULATOR_HOST": "http://x:1"})
    a, b = stack.nodes["nodeA"], stack.nodes["nodeB"]
    assert a.dir != b.dir and a.mount == b.mount
    for node in (a, b):
        env = node.node_env()
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(node.mount / "dags")
        assert env["CAIRN_WORKDIR"] == str(node.mount / "workdir")
        assert env["STORAGE_EMULATOR_HOST"] == "http://x:1"
        assert env["AIRFLOW__CELERY__BROKER_URL"] == stack.redis.url
    assert a.pid_base != b.pid_base


def test_a_node_name_must_be_a_host_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="letters and digits"):
        WorkerNode("node_a", cluster=tmp_path, dags=DAGS, env={}, log=tmp_path / "log")


def test_commits_after_counts_seqs_seen_not_snapshots_kept() -> None:
    """The store keeps the newest three: the kept list stops growing, the seen seqs do not."""
    kept = [[3, 4, 5], [4, 5, 6], [4, 5, 6], [5, 6, 7]]
    two_after_5 = commits_after(lambda: kept.pop(0), 5)
    assert [two_after_5() for _ in range(4)] == [False, False, False, True]
