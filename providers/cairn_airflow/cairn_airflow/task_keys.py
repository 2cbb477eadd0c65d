"""The cairn key of an Airflow task instance, which every cairn operator, the suspend
deferral and the UI plugin name it by."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def task_key(context: Mapping[str, Any]) -> Any:
    """The cairn key of the running task instance: ``(dag_id, task_id, run_id, map_index)``."""
    from cairn import Key

    ti = context["ti"]
    map_index = getattr(ti, "map_index", None)
    return Key((ti.dag_id, ti.task_id, ti.run_id, str(-1 if map_index is None else map_index)))
