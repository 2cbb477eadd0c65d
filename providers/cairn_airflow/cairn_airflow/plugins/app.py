"""The FastAPI app the api-server mounts at ``/cairn``: one task instance's snapshots.

Routes (query: ``dag_id``, ``task_id``, ``run_id``, ``map_index`` (default -1), ``verify``
= ``present`` | ``deep``, ``conn_id``: see below):

- ``GET /cairn/snapshots``: the HTML page (works without JavaScript);
- ``GET /cairn/api/snapshots``: the same report as JSON;
- ``POST /cairn/api/snapshots/suspend`` and ``.../resume`` (JSON body ``{"reason": ...}``,
  optional; a resume may add ``"placement"``, one of a pod-based step's capacity options), and ``POST /cairn/snapshots/suspend`` and ``.../resume`` (the page's forms,
  answered with a redirect back to the page): ask the key's running try to suspend, or lift
  its suspension (``Store.records.request_suspend`` / ``request_resume``, as ``cairn suspend`` and
  ``cairn resume`` do; the requester is the Airflow user). A key that is unknown answers 404,
  one that is not running or not suspended 409, and nothing is written;
- ``POST /cairn/api/snapshots/discard`` (JSON) and ``POST /cairn/snapshots/discard`` (the
  page's form, answered with a redirect back to the page): forget the key's snapshots
  (``Store.remove``: a ``done`` record fences a try still running, the next try starts fresh).

Airflow does not put plugin apps behind its authentication, so every route depends on
Airflow's own ``requires_access_dag("GET", TASK_INSTANCE)``: a valid JWT (``Authorization:
Bearer`` or the UI's ``_token`` cookie) of a user who may read that DAG's task instances.
Anonymous requests get 401, others 403; the page answers those with a short HTML page that
links to the login, the API with Airflow's JSON error. ``verify=deep`` (a full read of every
retained snapshot) needs the permission to edit the DAG and runs at most once per
``[cairn] deep_verify_interval_s`` (default 300) per task instance, else 429. Discarding needs
what clearing a task instance needs (``PUT`` on its task instances); a form post authenticated
by the cookie must come from the api-server's own origin; so do suspending and resuming.

The key is the operator's own (:func:`cairn_airflow.task_keys.task_key`); the store is that of
the ``cairn`` connection the task itself uses (its serialized ``cairn_conn_id``, else
``cairn_default``), parsed as :class:`cairn_airflow.hooks.CairnHook` does. A ``conn_id`` in the
query is honoured only when it is that connection or on the allow-list ``[cairn] ui_conn_ids``
(comma-separated), else 403: a DAG reader must not open another team's store
(docs/security.md). The page and the API name the connection, never the store's URL or
credentials. An operator's ``store_url=`` override is not known to the api-server; such tasks
need a connection naming the same store. For ``gs://`` stores the api-server uses its own
default credentials (a connection's ``gcs_keyfile_path`` is a path on the workers).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from types import SimpleNamespace
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode, urlsplit

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from fastapi import Body, Depends, FastAPI, Form, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from pydantic import BaseModel

from cairn.store import RequestKind
from cairn_airflow.hooks import DEFAULT_CONN_ID
from cairn_airflow.plugins.paths import API_PATH, PAGE_PATH, URL_PREFIX

DEEP_VERIFY_INTERVAL_S = 300.0
MAX_REASON = 200


@dataclass(frozen=True)
class UiSettings:
    """What the page may open: ``allowed_conn_ids`` besides each task's own connection, and
    how often one task instance may be deep-verified."""

    allowed_conn_ids: frozenset[str] = frozenset()
    deep_verify_interval_s: float = DEEP_VERIFY_INTERVAL_S

    @classmethod
    def from_config(cls) -> UiSettings:
        """From ``[cairn] ui_conn_ids`` and ``[cairn] deep_verify_interval_s``."""
        from airflow.configuration import conf

        names = conf.get("cairn", "ui_conn_ids", fallback="") or ""
        interval = conf.get("cairn", "deep_verify_interval_s", fallback="") or ""
        try:
            every = float(interval) if interval.strip() else DEEP_VERIFY_INTERVAL_S
        except ValueError:
            raise ValueError(f"[cairn] deep_verify_interval_s must be a number of seconds, not "
                             f"{interval!r}") from None
        return cls(frozenset(n.strip() for n in names.split(",") if n.strip()), every)


class _RateLimit:
    """At most one call per ``interval_s`` per key, in this api-server process."""

    def __init__(self, interval_s: float) -> None:
        self._interval = interval_s
        self._last: dict[Any, float] = {}
        self._lock = threading.Lock()

    def take(self, key: Any) -> None:
        """Record a call for ``key``; HTTPException 429 (with Retry-After) when too soon."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                wait = int(self._interval - (now - last)) + 1
                raise HTTPException(429, f"this task instance was deep-verified less than "
                                         f"{self._interval:g}s ago; try again in {wait}s",
                                    headers={"Retry-After": str(wait)})
            self._last[key] = now


class Verify(str, enum.Enum):
    """How far the page checks each snapshot."""

    PRESENT = "present"  # manifest reads and every pack exists (cheap)
    DEEP = "deep"  # read every chunk and check its digest


def parse_map_index(text: str | None) -> int:
    """``map_index`` from a query; an absent or untemplated value (``{MAP_INDEX}``, which the
    UI leaves for unmapped tasks) means -1."""
    if text is None or text.strip() in ("", "{MAP_INDEX}"):
        return -1
    try:
        return int(text)
    except ValueError:
        raise HTTPException(422, f"map_index must be an integer, not {text!r}") from None


def _store_config(conn_id: str) -> Any:
    """The store a ``cairn`` connection names, read the api-server's way (metadata DB, then
    environment and secrets backends; the Task SDK's ``BaseHook`` sees no DB here). A missing
    ``cairn_default`` means the local default store, as for the operator."""
    from airflow.exceptions import AirflowNotFoundException
    from airflow.models.connection import Connection

    from cairn_airflow.hooks import StoreConfig, default_store_url, store_config_from_connection

    try:
        conn = Connection.get_connection_from_secrets(conn_id)
    except AirflowNotFoundException:
        if conn_id != DEFAULT_CONN_ID:
            raise HTTPException(404, f"no connection {conn_id!r}") from None
        return StoreConfig(url=default_store_url(), source="default (no cairn_default)")
    if conn.conn_type != "cairn":
        # Say nothing of its host: the reader may not read connections.
        raise HTTPException(400, f"connection {conn_id!r} is not a cairn connection")
    return store_config_from_connection(conn)


def open_config_store(config: Any) -> Any:
    """The existing store a connection names, opened with its secret when it gives one (an
    encrypted store), passed rather than set in the api-server's environment."""
    import os

    from cairn.runtime.stores import open_store

    return open_store(config.url, create=False, environ={**os.environ, **config.env})


def usable_store_config(conn_id: str) -> Any:
    """:func:`_store_config`; HTTPException 400 for a connection cairn cannot use, naming only
    its error's type (the message may hold the store's URL)."""
    from cairn.exceptions import CairnError

    try:
        return _store_config(conn_id)
    except CairnError as e:
        raise HTTPException(400, f"connection {conn_id!r} is unusable ({type(e).__name__})"
                            ) from None


def ti_key(dag_id: str, task_id: str, run_id: str, map_index: int) -> Any:
    """The task instance's key, as its operator makes it
    (:func:`cairn_airflow.task_keys.task_key`)."""
    from cairn_airflow.task_keys import task_key

    return task_key({"ti": SimpleNamespace(dag_id=dag_id, task_id=task_id, run_id=run_id,
                                           map_index=map_index)})


def task_conn_id(session: Any, dag_id: str, task_id: str) -> str:
    """The ``cairn`` connection the task itself uses, from its serialized DAG (``cairn_conn_id``
    when the operator serialized it, else ``cairn_default``). HTTPException 404 for a DAG or
    task the metadata DB does not know."""
    from airflow.models.dagbag import DBDagBag

    dag = DBDagBag().get_latest_version_of_dag(dag_id, session=session)
    if dag is None:
        raise HTTPException(404, f"no DAG {dag_id!r}")
    task = dag.task_dict.get(task_id)
    if task is None:
        raise HTTPException(404, f"DAG {dag_id!r} has no task {task_id!r}")
    own = getattr(task, "cairn_conn_id", None)
    return own if isinstance(own, str) and own else DEFAULT_CONN_ID


def choose_conn_id(own: str, requested: str | None, settings: UiSettings) -> str:
    """The connection a request may open: the task's own, or an allow-listed one it names.
    HTTPException 403 for any other (the query is the user's, not the DAG author's)."""
    if requested is None or requested == own:
        return own
    if requested in settings.allowed_conn_ids:
        return requested
    raise HTTPException(403, f"connection {requested!r} is not the one this task uses; an "
                             "Airflow admin may allow it in [cairn] ui_conn_ids")


def _airflow_tries(session: Any, *, dag_id: str, task_id: str, run_id: str,
                   map_index: int) -> list[Any]:
    """Each try of the task instance with its state (the current one and its history)."""
    from sqlalchemy import select

    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from cairn_airflow.plugins.report import AirflowTry

    tries = {}
    for model in (TaskInstanceHistory, TaskInstance):
        rows = session.scalars(select(model).where(
            model.dag_id == dag_id, model.task_id == task_id, model.run_id == run_id,
            model.map_index == map_index))
        for row in rows:
            tries[row.try_number] = AirflowTry(
                try_number=row.try_number, state=str(row.state) if row.state else None,
                start_date=row.start_date, end_date=row.end_date)
    return sorted(tries.values(), key=lambda t: t.try_number)


def _outcomes(store: Any, key: Any) -> list[Any] | None:
    """The key's outcome records (``Store.records.outcomes``), or None when this cairn has none."""
    reader = getattr(getattr(store, "records", None), "outcomes", None)
    return None if reader is None else list(reader(key))


Ti = tuple[str, str, str, "str | None"]


def ti_query(dag_id: Annotated[str, Query(min_length=1)],
             task_id: Annotated[str, Query(min_length=1)],
             run_id: Annotated[str, Query(min_length=1)],
             map_index: str | None = None) -> Ti:
    """The task instance a request names (``map_index`` parsed later: see parse_map_index)."""
    return dag_id, task_id, run_id, map_index


def build(dag_id: str, task_id: str, run_id: str, map_index: int, *, verify: Verify,
          conn_id: str, session: Any = None) -> Any:
    """The :class:`~cairn_airflow.plugins.report.TaskReport` of one task instance."""
    from cairn.exceptions import CairnError
    from cairn_airflow.plugins.report import TaskReport, build_report

    key = ti_key(dag_id, task_id, run_id, map_index)
    # Readers see which connection, never the store's URL (it may name another team's bucket
    # layout, and a URL is a step towards its credentials).
    label = f"connection {conn_id}"
    config = usable_store_config(conn_id)
    try:
        store = open_config_store(config)
    except CairnError as e:  # no store yet: nothing was ever snapshotted there
        return TaskReport(key=str(key), store=label, state="no records",
                          notes=(str(e).replace(config.url, label),))
    with store:
        tries = (_airflow_tries(session, dag_id=dag_id, task_id=task_id, run_id=run_id,
                                map_index=map_index) if session is not None else [])
        report = build_report(store, key, deep=verify is Verify.DEEP, airflow_tries=tries,
                              outcomes=_outcomes(store, key))
    return dataclasses.replace(report, store=label, notes=tuple(
        n.replace(config.url, label).replace(store.url, label) for n in report.notes))


def discard(dag_id: str, task_id: str, run_id: str, map_index: int, *, conn_id: str) -> Any:
    """Forget the task instance's snapshots; returns (key, number removed)."""
    from cairn.exceptions import CairnError

    key = ti_key(dag_id, task_id, run_id, map_index)
    try:
        config = _store_config(conn_id)
        with open_config_store(config) as store:
            if not store.history(key):
                raise HTTPException(404, f"key {key} has no records in connection {conn_id}")
            return key, store.remove(key)
    except CairnError as e:
        raise HTTPException(400, f"connection {conn_id!r}: {type(e).__name__}") from None


class AskBody(BaseModel):
    """The JSON body of a suspend or resume request (optional); a resume may name a
    ``placement``, one of a pod-based step's capacity options, to move it to."""

    reason: str | None = None
    placement: str | None = None


def check_reason(reason: str | None) -> str | None:
    """A one-line reason of at most 200 characters (None when empty); 422 otherwise."""
    text = (reason or "").strip()
    if not text:
        return None
    if "\n" in text or "\r" in text or len(text) > MAX_REASON:
        raise HTTPException(422, f"a reason must be one line of at most {MAX_REASON} "
                                 "characters")
    return text


def check_placement(kind: RequestKind, placement: str | None) -> str | None:
    """A capacity option's name (None when empty), asked for with a resume only; 422
    otherwise. Whether the step has that option is the store's to say (409)."""
    name = (placement or "").strip()
    if not name:
        return None
    if kind is not RequestKind.RESUME:
        raise HTTPException(422, "only a resume names a placement")
    return check_reason(name)


def ask(dag_id: str, task_id: str, run_id: str, map_index: int, *, conn_id: str,
        kind: RequestKind, by: str, reason: str | None,
        placement: str | None = None) -> dict[str, Any]:
    """Make the suspend or resume request for the task instance's key; returns the key, the
    request and the suspension as JSON. HTTPException 404 (unknown key or store) or 409 (not
    running, done, not suspended), and then nothing was written."""
    from cairn.exceptions import CairnError, ConfigError, NotFound

    key = ti_key(dag_id, task_id, run_id, map_index)
    label = f"connection {conn_id}"
    config = usable_store_config(conn_id)
    try:
        with open_config_store(config) as store:
            if kind is RequestKind.SUSPEND:
                made = store.records.request_suspend(key, by=by, reason=reason)
            else:
                made = store.records.request_resume(key, by=by, reason=reason, placement=placement)
            current = store.records.suspension(key)
    except NotFound as e:
        raise HTTPException(404, str(e).replace(config.url, label)) from None
    except ConfigError as e:
        raise HTTPException(409, str(e).replace(config.url, label)) from None
    except CairnError as e:
        raise HTTPException(400, f"{label}: {type(e).__name__}") from None
    return {"key": str(key), "request": made.to_json(),
            "suspension": current.to_json() if current is not None else None}


def requester(user: Any) -> str:
    """Who the request is recorded as made by: the Airflow user."""
    try:
        name = user.get_name()
    except Exception:  # noqa: BLE001 - a user without a name still asks
        name = None
    return f"{name or 'unknown'} (Airflow)"


def same_origin(request: Request) -> None:
    """Refuse a cookie-authenticated post from another origin (the cookie is SameSite=Lax;
    this also covers same-site neighbours). Bearer-token clients are not browsers' forms."""
    if request.headers.get("authorization"):
        return
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise HTTPException(403, f"refusing a form post from origin {origin!r}")


def create_app(*, settings: UiSettings | None = None) -> FastAPI:
    """The plugin's app (the api-server mounts it at ``/cairn``); ``settings`` default to
    :meth:`UiSettings.from_config`."""
    ui = settings if settings is not None else UiSettings.from_config()
    deep_limit = _RateLimit(ui.deep_verify_interval_s)
    # The one gate of every route: Airflow's own user and DAG-permission dependency.
    can_read = [Depends(requires_access_dag("GET", DagAccessEntity.TASK_INSTANCE))]
    can_discard = [Depends(requires_access_dag("PUT", DagAccessEntity.TASK_INSTANCE)),
                   Depends(same_origin)]
    can_edit_dag = requires_access_dag("PUT")
    app = FastAPI(title="cairn snapshots", description="A cairn task's snapshots and attempts.",
                  docs_url=None, redoc_url=None, openapi_url=None)

    def allowed(request: Request, user: Any, session: Any, ti: Ti, verify: Verify,
                conn_id: str | None) -> tuple[int, str]:
        """The map index and the connection this request may open; a deep verify is checked
        against the DAG edit permission and the rate limit."""
        dag_id, task_id, run_id, map_index = ti
        index = parse_map_index(map_index)
        chosen = choose_conn_id(task_conn_id(session, dag_id, task_id), conn_id, ui)
        if verify is Verify.DEEP:
            can_edit_dag(request, user)  # 403 unless the user may edit the DAG
            deep_limit.take((dag_id, task_id, run_id, index))
        return index, chosen

    def authorized_report(request: Request, user: Any, session: Any, ti: Ti, verify: Verify,
                          conn_id: str | None) -> tuple[int, str, Any]:
        """The map index, the connection chosen and the report, once ``allowed`` passed."""
        dag_id, task_id, run_id, _ = ti
        index, chosen = allowed(request, user, session, ti, verify, conn_id)
        report = build(dag_id, task_id, run_id, index, verify=verify, conn_id=chosen,
                       session=session)
        return index, chosen, report

    def authorized_discard(request: Request, user: Any, session: Any, ti: Ti,
                           conn_id: str | None) -> tuple[int, str, Any, int]:
        """The map index, the connection chosen, the key and the snapshots removed."""
        dag_id, task_id, run_id, _ = ti
        index, chosen = allowed(request, user, session, ti, Verify.PRESENT, conn_id)
        key, removed = discard(dag_id, task_id, run_id, index, conn_id=chosen)
        return index, chosen, key, removed

    @app.get(API_PATH, dependencies=can_read)
    def snapshots_json(request: Request, session: SessionDep, user: GetUserDep,
                       ti: Annotated[Ti, Depends(ti_query)], verify: Verify = Verify.PRESENT,
                       conn_id: str | None = None) -> JSONResponse:
        _, _, report = authorized_report(request, user, session, ti, verify, conn_id)
        return JSONResponse(report.to_json())

    @app.get(PAGE_PATH, dependencies=can_read, response_class=HTMLResponse)
    def snapshots_page(request: Request, session: SessionDep, user: GetUserDep,
                       ti: Annotated[Ti, Depends(ti_query)], verify: Verify = Verify.PRESENT,
                       conn_id: str | None = None) -> HTMLResponse:
        from cairn_airflow.plugins.page import page_links, render_page, request_links

        dag_id, task_id, run_id, _ = ti
        index, chosen, report = authorized_report(request, user, session, ti, verify, conn_id)
        names = {"dag_id": dag_id, "task_id": task_id, "run_id": run_id,
                 "map_index": str(index)}
        if conn_id is not None:
            names["conn_id"] = chosen
        prefix = str(request.scope.get("root_path", "")).rstrip("/")
        api_url, verify_url, discard_url = page_links(prefix, names)
        suspend_url, resume_url = request_links(prefix, names)
        discarded = request.query_params.get("discarded", "")
        return HTMLResponse(render_page(report, ti=names, api_url=api_url,
                                        verify_url=verify_url, discard_url=discard_url,
                                        discarded=discarded if discarded.isdigit() else None,
                                        suspend_url=suspend_url, resume_url=resume_url,
                                        asked=request.query_params.get("asked")))

    @app.post(API_PATH + "/discard", dependencies=can_discard)
    def discard_json(request: Request, session: SessionDep, user: GetUserDep,
                     ti: Annotated[Ti, Depends(ti_query)],
                     conn_id: str | None = None) -> JSONResponse:
        _, _, key, removed = authorized_discard(request, user, session, ti, conn_id)
        return JSONResponse({"key": str(key), "snapshots_removed": removed})

    @app.post(PAGE_PATH + "/discard", dependencies=can_discard)
    def discard_form(request: Request, session: SessionDep, user: GetUserDep,
                     ti: Annotated[Ti, Depends(ti_query)],
                     conn_id: str | None = None) -> RedirectResponse:
        dag_id, task_id, run_id, _ = ti
        index, chosen, _, removed = authorized_discard(request, user, session, ti, conn_id)
        names = {"dag_id": dag_id, "task_id": task_id, "run_id": run_id,
                 "map_index": str(index), "discarded": str(removed)}
        if conn_id is not None:
            names["conn_id"] = chosen
        prefix = str(request.scope.get("root_path", "")).rstrip("/")
        return RedirectResponse(f"{prefix}{PAGE_PATH}?{urlencode(names)}", status_code=303)

    def authorized_ask(request: Request, user: Any, session: Any, ti: Ti, conn_id: str | None,
                       kind: RequestKind, reason: str | None,
                       placement: str | None = None) -> tuple[int, str, dict[str, Any]]:
        """The map index, the connection chosen and what ``ask`` made."""
        dag_id, task_id, run_id, _ = ti
        index, chosen = allowed(request, user, session, ti, Verify.PRESENT, conn_id)
        made = ask(dag_id, task_id, run_id, index, conn_id=chosen, kind=kind,
                   by=requester(user), reason=check_reason(reason),
                   placement=check_placement(kind, placement))
        return index, chosen, made

    def add_ask_routes(kind: RequestKind) -> None:
        """``POST .../suspend`` or ``.../resume``: the JSON API and the page's form."""
        @app.post(f"{API_PATH}/{kind.value}", dependencies=can_discard)
        def ask_json(request: Request, session: SessionDep, user: GetUserDep,
                     ti: Annotated[Ti, Depends(ti_query)],
                     body: Annotated[AskBody | None, Body()] = None,
                     conn_id: str | None = None) -> JSONResponse:
            reason = body.reason if body is not None else None
            placement = body.placement if body is not None else None
            _, _, made = authorized_ask(request, user, session, ti, conn_id, kind, reason,
                                        placement)
            return JSONResponse(made)

        @app.post(f"{PAGE_PATH}/{kind.value}", dependencies=can_discard)
        def ask_form(request: Request, session: SessionDep, user: GetUserDep,
                     ti: Annotated[Ti, Depends(ti_query)],
                     reason: Annotated[str | None, Form()] = None,
                     placement: Annotated[str | None, Form()] = None,
                     conn_id: str | None = None) -> RedirectResponse:
            dag_id, task_id, run_id, _ = ti
            index, chosen, _ = authorized_ask(request, user, session, ti, conn_id, kind, reason,
                                              placement)
            names = {"dag_id": dag_id, "task_id": task_id, "run_id": run_id,
                     "map_index": str(index), "asked": kind.value}
            if conn_id is not None:
                names["conn_id"] = chosen
            prefix = str(request.scope.get("root_path", "")).rstrip("/")
            return RedirectResponse(f"{prefix}{PAGE_PATH}?{urlencode(names)}",
                                    status_code=303)

    for kind in RequestKind:
        add_ask_routes(kind)

    @app.exception_handler(HTTPException)
    def refuse(request: Request, exc: HTTPException) -> Any:
        path = request.url.path.rstrip("/")
        html = path.endswith(tuple(URL_PREFIX + PAGE_PATH + tail for tail in
                                   ("", "/discard", "/suspend", "/resume")))
        if html and exc.status_code in (401, 403):
            return HTMLResponse(_refusal_page(exc.status_code, str(exc.detail)),
                                status_code=exc.status_code)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    return app


def _refusal_page(status: int, detail: str) -> str:
    from html import escape

    from airflow.api_fastapi.app import get_auth_manager

    try:
        login = get_auth_manager().get_url_login()
    except Exception:  # noqa: BLE001 - the refusal must render whatever the auth manager does
        login = "/"
    what = ("Sign in to Airflow to see this task's snapshots." if status == 401 else
            "Your Airflow user may not read this DAG's task instances, or not do this.")
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>cairn snapshots: "
            f"refused</title></head><body><h1 id=\"refused\">{status}: {escape(detail)}</h1>"
            f"<p>{escape(what)} <a href=\"{escape(login)}\">"
            "Sign in</a></p></body></html>")
