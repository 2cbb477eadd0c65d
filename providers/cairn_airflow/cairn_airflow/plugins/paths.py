"""Where the plugin's app lives on the api-server (no Airflow import at module level)."""

from __future__ import annotations

from urllib.parse import urlencode, urlsplit

URL_PREFIX = "/cairn"  # the app's mount point
PAGE_PATH = "/snapshots"
API_PATH = "/api/snapshots"


def base_path() -> str:
    """The path the api-server is served under (``[api] base_url``), without a trailing ``/``."""
    from airflow.configuration import conf

    return urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


def snapshots_url(*, dag_id: str, task_id: str, run_id: str, map_index: int | str = -1) -> str:
    """The snapshots page of one task instance, as a path on the api-server's host."""
    query = urlencode({"dag_id": dag_id, "task_id": task_id, "run_id": run_id,
                       "map_index": map_index})
    return f"{base_path()}{URL_PREFIX}{PAGE_PATH}?{query}"


def external_view_href() -> str:
    """The page's URL with the placeholders the Airflow UI fills in for a task instance."""
    return (f"{base_path()}{URL_PREFIX}{PAGE_PATH}?dag_id={{DAG_ID}}&run_id={{RUN_ID}}"
            "&task_id={TASK_ID}&map_index={MAP_INDEX}")
