"""cairn's Apache Airflow 3 provider: tasks whose retries resume from the last snapshot.

::

    from airflow.sdk import dag, task

    @task.cairn(every_steps=50, retries=3)
    def train(ckpt):                       # a cairn Checkpointer, keyed by the task instance
        start = ckpt.restore(model=model, optimizer=opt)
        for step in range(start, 1000):
            ...
            ckpt.step(step)

Importing this package imports neither Airflow, torch nor cairn's process mode (CRIU): the
scheduler, dag-processor and api-server load it through the ``apache_airflow_provider`` entry
point. Names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

if TYPE_CHECKING:
    from cairn_airflow.decorators import cairn_task
    from cairn_airflow.hooks import CairnHook
    from cairn_airflow.command import CairnRunOperator
    from cairn_airflow.kubernetes import CairnKubernetesPodOperator
    from cairn_airflow.operators import CairnPythonOperator

__all__ = ["CairnHook", "CairnKubernetesPodOperator", "CairnPythonOperator", "CairnRunOperator",
           "cairn_task", "get_provider_info", "__version__"]

_LAZY = {
    "cairn_task": "cairn_airflow.decorators",
    "CairnHook": "cairn_airflow.hooks",
    "CairnPythonOperator": "cairn_airflow.operators",
    "CairnRunOperator": "cairn_airflow.command",
    "CairnKubernetesPodOperator": "cairn_airflow.kubernetes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cairn_airflow' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def _connection_type() -> dict[str, Any]:
    """The ``cairn`` connection's form: the store URL, then each store kind's own fields."""
    from cairn.store import store_kinds, url_forms

    fields: dict[str, Any] = {"store_url": {
        "label": "Store URL",
        "description": f"A directory or a bucket: {url_forms()}",
        "schema": {"type": ["string", "null"]},
    }}
    for kind in store_kinds():
        for f in kind.connection_fields:
            fields[f.extra] = {"label": f.label, "description": f.description,
                               "schema": {"type": ["string", "null"]}}
    return {
        "connection-type": "cairn",
        "hook-class-name": "cairn_airflow.hooks.CairnHook",
        "hook-name": "cairn store",
        "conn-fields": fields,
        "ui-field-behaviour": {
            "hidden-fields": ["schema", "login", "password", "port"],
            "relabeling": {"host": "Store URL (or set it in the field below)"},
            "placeholders": {"host": url_forms()},
        },
    }


def get_provider_info() -> dict[str, Any]:
    """What Airflow's providers manager reads through the ``apache_airflow_provider`` entry point
    (``package-name`` must equal the distribution name)."""
    return {
        "package-name": "airflow-provider-cairn",
        "name": "cairn",
        "description": "Snapshots that let long Airflow tasks resume where they stopped after a "
                       "preemption or failure: the @task.cairn decorator and the cairn connection.",
        "versions": [__version__],
        "integrations": [{"integration-name": "cairn", "tags": ["software"]}],
        "hooks": [{"integration-name": "cairn", "python-modules": ["cairn_airflow.hooks"]}],
        "operators": [{"integration-name": "cairn", "python-modules": ["cairn_airflow.operators",
                                                                     "cairn_airflow.command",
                                                                     "cairn_airflow.kubernetes"]}],
        "connection-types": [_connection_type()],
        "task-decorators": [{"name": "cairn", "class-name": "cairn_airflow.decorators.cairn_task"}],
        "extra-links": ["cairn_airflow.plugins.links.CairnSnapshotsLink"],
    }
