"""The "cairn snapshots" extra link on cairn task instances.

The plugin registers it for :class:`~cairn_airflow.operators.CairnPythonOperator` and the
operator behind ``@task.cairn``; the api-server then computes it from the task instance's
key alone (no XCom, no worker involvement), so it exists from the first try on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperatorLink

from cairn_airflow.decorators import _CairnDecoratedOperator
from cairn_airflow.operators import CairnPythonOperator
from cairn_airflow.plugins.paths import snapshots_url

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey


class CairnSnapshotsLink(BaseOperatorLink):
    """Opens the task instance's cairn snapshots page."""

    name = "cairn snapshots"
    operators: ClassVar[list[type[Any]]] = [CairnPythonOperator, _CairnDecoratedOperator]

    def get_link(self, operator: Any, *, ti_key: TaskInstanceKey) -> str:
        return snapshots_url(dag_id=ti_key.dag_id, task_id=ti_key.task_id,
                             run_id=ti_key.run_id, map_index=ti_key.map_index)
