"""Every cairn operator serializes its ``cairn_conn_id``: the snapshots page reads the
serialized DAG to open the connection the task itself uses (issue 15)."""

from __future__ import annotations

from airflow.sdk import DAG
from airflow.serialization.serialized_objects import DagSerialization

from cairn_airflow.command import CairnRunOperator
from cairn_airflow.kubernetes import CairnKubernetesPodOperator
from cairn_airflow.operators import CairnPythonOperator


def test_the_connection_survives_dag_serialization() -> None:
    with DAG("serialized", schedule=None) as dag:
        CairnPythonOperator(task_id="python", python_callable=lambda: None,
                            cairn_conn_id="python_store")
        CairnRunOperator(task_id="run", command=["true"], cairn_conn_id="run_store")
        CairnKubernetesPodOperator(task_id="pod", image="repo/train:1", cmds=["python"],
                                   sidecar_image="repo/cairn-sidecar:1",
                                   cairn_conn_id="pod_store")
    tasks = {t["__var"]["task_id"]: t["__var"]
             for t in DagSerialization.to_dict(dag)["dag"]["tasks"]}
    assert {name: t.get("cairn_conn_id") for name, t in tasks.items()} == {
        "python": "python_store", "run": "run_store", "pod": "pod_store"}
    restored = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert restored.get_task("run").cairn_conn_id == "run_store"
