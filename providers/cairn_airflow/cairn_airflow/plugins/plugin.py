"""The cairn Airflow plugin (``airflow.plugins`` entry point ``cairn``).

- a FastAPI app at ``/cairn`` (:mod:`cairn_airflow.plugins.app`), behind Airflow's own
  authentication and DAG permissions;
- an external view "cairn snapshots" on the task instance page (an iframe of that app);
- the "cairn snapshots" extra link on cairn operators.

Every Airflow process loads plugins; the app (and Airflow's API security module it needs) is
built only when the api-server asks for ``fastapi_apps``.
"""

from __future__ import annotations

import functools
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from cairn_airflow.plugins.paths import URL_PREFIX, external_view_href


class CairnPlugin(AirflowPlugin):
    name = "cairn"

    @functools.cached_property
    def external_views(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [{"name": "cairn snapshots", "href": external_view_href(),
                 "destination": "task_instance", "url_route": "cairn-snapshots"}]

    @functools.cached_property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        from cairn_airflow.plugins.app import create_app

        return [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "cairn snapshots"}]

    @functools.cached_property
    def operator_extra_links(self) -> list[Any]:  # type: ignore[override]
        from cairn_airflow.plugins.links import CairnSnapshotsLink

        return [CairnSnapshotsLink()]
