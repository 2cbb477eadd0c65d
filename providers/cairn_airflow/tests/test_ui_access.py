"""Issue 15: what the snapshots page lets each Airflow user open, behind Airflow's real
``requires_access_dag`` and ``/auth/token`` login.

The auth manager is Airflow's Simple one narrowed to one DAG (:class:`OneDagAuthManager`, a
subclass defined here: the FAB auth manager, which grants per-DAG access natively, cannot be
installed next to this Airflow's constraints yet). Two DAGs are serialized into the metadata DB
and three stores hold snapshots of their keys: the task's own (``cairn_default``), another
team's (``team_b``, a real ``cairn`` connection nobody allow-listed) and one on the allow-list
(``team_shared``). Checked: a reader of one DAG sees that DAG's page, another DAG's page answers
403, a forged ``conn_id`` is refused without a word of that store, a task whose operator
serializes its ``cairn_conn_id`` opens that connection's store, the store URL is never shown,
deep verification needs edit access and is rate-limited per task, discard needs clear access.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

MINE, OTHER, TASK_ID, RUN_ID = "cairn_ui_mine", "cairn_ui_other", "train", "manual__ui-access"
TEAM_B_DAG = "cairn_ui_team_b"  # its task uses connection team_b, and says so in its DAG
PASSWORDS = {"reader": "reader-pw", "editor": "editor-pw"}


class OneDagAuthManager(SimpleAuthManager):
    """Simple auth manager whose users reach DAG ``cairn_ui_mine`` (and ``cairn_ui_team_b``)
    only (its reader reads it, its editor edits it); everything else the Simple manager
    decides as usual."""

    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None,
                          details: Any = None) -> bool:
        if details is None or details.id not in (MINE, TEAM_B_DAG):
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity,
                                         details=details)


def _dag(dag_id: str, conn_id: str | None = None) -> Any:
    from airflow.sdk import DAG

    from cairn_airflow.operators import CairnPythonOperator

    class Serialized(CairnPythonOperator):
        """Serializes its connection, as the page needs to find the task's own store."""

        @classmethod
        def get_serialized_fields(cls) -> frozenset[str]:
            return frozenset(super().get_serialized_fields() | {"cairn_conn_id"})

    with DAG(dag_id, schedule=None) as dag:
        if conn_id is None:
            CairnPythonOperator(task_id=TASK_ID, python_callable=lambda ckpt: None)
        else:
            Serialized(task_id=TASK_ID, python_callable=lambda ckpt: None, cairn_conn_id=conn_id)
    return dag


@pytest.fixture(scope="module")
def stores(airflow_db: Path, tmp_path_factory: pytest.TempPathFactory,
           write_snapshots: Callable[..., None],
           sync_dags: Callable[..., None]) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("cairn-ui-access")
    paths = {name: root / f"store-{name}" for name in ("own", "team_b", "shared")}
    passwords = root / "passwords.json"
    passwords.write_text(json.dumps(PASSWORDS))
    env = {
        "AIRFLOW_CONN_CAIRN_DEFAULT": json.dumps({"conn_type": "cairn",
                                                  "extra": {"store_url": str(paths["own"])}}),
        "AIRFLOW_CONN_TEAM_B": json.dumps({"conn_type": "cairn",
                                           "extra": {"store_url": str(paths["team_b"])}}),
        "AIRFLOW_CONN_TEAM_SHARED": json.dumps({"conn_type": "cairn",
                                                "extra": {"store_url": str(paths["shared"])}}),
        "AIRFLOW__CORE__AUTH_MANAGER": f"{__name__}.OneDagAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "reader:viewer,editor:user",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__API_AUTH__JWT_SECRET": "cairn-ui-access-" + "0123456789abcdef" * 4,
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        sync_dags(_dag(MINE), _dag(OTHER), _dag(TEAM_B_DAG, "team_b"))
        for store, dag_id, marker, count in [("own", MINE, b"own", 2),
                                             ("own", OTHER, b"other-dag", 1),
                                             ("team_b", MINE, b"team-b-secret", 3),
                                             ("shared", MINE, b"shared", 3),
                                             ("team_b", TEAM_B_DAG, b"team-b-own", 2)]:
            write_snapshots(str(paths[store]), (dag_id, TASK_ID, RUN_ID, "-1"), marker, count)
        yield paths


@pytest.fixture(scope="module")
def client(stores: dict[str, Path]) -> Iterator[Any]:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from airflow.api_fastapi.app import init_auth_manager, purge_cached_app
    from cairn_airflow.plugins.app import UiSettings, create_app
    from cairn_airflow.plugins.paths import URL_PREFIX

    app = FastAPI()
    init_auth_manager(app)
    # Mounted as the api-server mounts the plugin's app, with the allow-list given directly.
    app.mount(URL_PREFIX, create_app(settings=UiSettings(frozenset({"team_shared"}))))
    try:
        with TestClient(app) as client:
            yield client
    finally:
        purge_cached_app()  # the next module's auth manager is its own


def _auth(client: Any, user: str) -> dict[str, str]:
    response = client.post("/auth/token", json={"username": user, "password": PASSWORDS[user]})
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['access_token']}"}


def _query(dag_id: str = MINE, **extra: str) -> str:
    return urlencode({"dag_id": dag_id, "task_id": TASK_ID, "run_id": RUN_ID, "map_index": -1,
                      **extra})


def test_a_reader_of_one_dag_sees_its_page_and_not_the_store_url(client: Any,
                                                                 stores: dict[str, Path]) -> None:
    reader = _auth(client, "reader")
    page = client.get(f"/cairn/snapshots?{_query()}", headers=reader)
    assert page.status_code == 200, page.text
    assert page.text.count('class="snapshot-row"') == 2
    api = client.get(f"/cairn/api/snapshots?{_query()}", headers=reader)
    assert api.status_code == 200 and [s["step"] for s in api.json()["snapshots"]] == [1, 0]
    assert api.json()["store"] == "connection cairn_default"
    for body in (page.text, api.text):
        assert str(stores["own"]) not in body and "store-own" not in body


def test_another_dags_page_answers_403(client: Any) -> None:
    reader = _auth(client, "reader")
    page = client.get(f"/cairn/snapshots?{_query(OTHER)}", headers=reader)
    assert page.status_code == 403 and 'id="refused"' in page.text
    assert "snapshot-row" not in page.text
    api = client.get(f"/cairn/api/snapshots?{_query(OTHER)}", headers=reader)
    assert api.status_code == 403 and api.json() == {"detail": "Forbidden"}


def test_a_forged_conn_id_is_refused(client: Any, stores: dict[str, Path]) -> None:
    for user in ("reader", "editor"):
        headers = _auth(client, user)
        for path in ("/cairn/snapshots", "/cairn/api/snapshots"):
            forged = client.get(f"{path}?{_query(conn_id='team_b')}", headers=headers)
            assert forged.status_code == 403, forged.text
            assert "not the one this task uses" in forged.text
            assert str(stores["team_b"]) not in forged.text and "snapshot-row" not in forged.text
        discard = client.post(f"/cairn/api/snapshots/discard?{_query(conn_id='team_b')}",
                              headers=headers)
        assert discard.status_code == 403
    from cairn.store import Key
    from cairn import open_store

    with open_store(str(stores["team_b"])) as store:  # nothing of team_b's was touched
        assert len(store.snapshots(Key((MINE, TASK_ID, RUN_ID, "-1")))) == 3


def test_an_allow_listed_connection_opens(client: Any, stores: dict[str, Path]) -> None:
    reader = _auth(client, "reader")
    shared = client.get(f"/cairn/api/snapshots?{_query(conn_id='team_shared')}", headers=reader)
    assert shared.status_code == 200, shared.text
    assert len(shared.json()["snapshots"]) == 3
    assert shared.json()["store"] == "connection team_shared"
    assert str(stores["shared"]) not in shared.text
    own = client.get(f"/cairn/api/snapshots?{_query(conn_id='cairn_default')}", headers=reader)
    assert own.status_code == 200 and len(own.json()["snapshots"]) == 2


def test_a_task_with_its_own_connection_opens_that_store(client: Any,
                                                        stores: dict[str, Path]) -> None:
    reader = _auth(client, "reader")
    own = client.get(f"/cairn/api/snapshots?{_query(TEAM_B_DAG)}", headers=reader)
    assert own.status_code == 200, own.text
    assert own.json()["store"] == "connection team_b" and len(own.json()["snapshots"]) == 2
    assert str(stores["team_b"]) not in own.text
    # For this task, cairn_default is the foreign one.
    other = client.get(f"/cairn/api/snapshots?{_query(TEAM_B_DAG, conn_id='cairn_default')}",
                       headers=reader)
    assert other.status_code == 403 and "not the one this task uses" in other.text


def test_an_unknown_task_is_not_found(client: Any) -> None:
    reader = _auth(client, "reader")
    missing = client.get(f"/cairn/api/snapshots?{_query(task_id='nope')}".replace(
        f"task_id={TASK_ID}&", ""), headers=reader)
    assert missing.status_code == 404 and "no task 'nope'" in missing.text


def test_deep_verify_needs_edit_access_and_is_rate_limited(client: Any) -> None:
    deep = f"/cairn/api/snapshots?{_query(verify='deep')}"
    refused = client.get(deep, headers=_auth(client, "reader"))
    assert refused.status_code == 403
    editor = _auth(client, "editor")
    first = client.get(deep, headers=editor)
    assert first.status_code == 200, first.text
    assert first.json()["deep_verified"]
    assert {s["status"] for s in first.json()["snapshots"]} == {"verified"}
    again = client.get(deep, headers=editor)
    assert again.status_code == 429 and int(again.headers["retry-after"]) > 0
    # Per task instance: the cheap check still answers.
    assert client.get(f"/cairn/api/snapshots?{_query()}", headers=editor).status_code == 200


def test_suspend_and_resume_need_clear_access(client: Any, stores: dict[str, Path]) -> None:
    """Issue 19: the page's suspend and resume write request records as `cairn suspend` and
    `cairn resume` do, recorded as made by the Airflow user; readers and other DAGs' users
    are refused and nothing is written."""
    from cairn.store import Key
    from cairn import open_store

    key = Key((MINE, TASK_ID, RUN_ID, "-1"))
    reader, editor = _auth(client, "reader"), _auth(client, "editor")
    for kind in ("suspend", "resume"):
        assert client.post(f"/cairn/api/snapshots/{kind}?{_query()}",
                           headers=reader).status_code == 403
        assert client.post(f"/cairn/api/snapshots/{kind}?{_query(OTHER)}",
                           headers=editor).status_code == 403
        forged = client.post(f"/cairn/api/snapshots/{kind}?{_query(conn_id='team_b')}",
                             headers=editor)
        assert forged.status_code == 403
    with open_store(str(stores["own"])) as store:
        assert store.records.suspension(key) is None
    with open_store(str(stores["team_b"])) as store:
        assert store.records.suspension(key) is None

    refused = client.post(f"/cairn/api/snapshots/resume?{_query()}", headers=editor)
    assert refused.status_code == 409 and "not suspended" in refused.json()["detail"]
    unknown = client.post(f"/cairn/api/snapshots/suspend?{_query(run_id='manual__nope')}",
                          headers=editor)
    assert unknown.status_code == 404 and "unknown" in unknown.json()["detail"]
    bad = client.post(f"/cairn/api/snapshots/suspend?{_query()}", headers=editor,
                      json={"reason": "two\nlines"})
    assert bad.status_code == 422

    asked = client.post(f"/cairn/api/snapshots/suspend?{_query()}", headers=editor,
                        json={"reason": "the GPUs are needed"})
    assert asked.status_code == 200, asked.text
    body = asked.json()
    assert body["request"]["by"] == "editor (Airflow)"
    assert body["suspension"]["state"] == "suspend-requested"
    assert body["suspension"]["reason"] == "the GPUs are needed"
    again = client.post(f"/cairn/api/snapshots/suspend?{_query()}", headers=editor)
    assert again.json()["request"] == body["request"], "a second suspend changed something"
    page = client.get(f"/cairn/snapshots?{_query()}", headers=reader)
    assert 'id="suspend-state">suspend-requested' in page.text
    assert "asked by editor (Airflow)" in page.text and "the GPUs are needed" in page.text
    assert 'id="resume"' in page.text and 'id="suspend"' not in page.text

    # The page's form: a redirect back to the page, which says what was asked.
    form = client.post(f"/cairn/snapshots/resume?{_query()}", headers=editor,
                       data={"reason": "urgent job done"}, follow_redirects=False)
    assert form.status_code == 303, form.text
    assert "asked=resume" in form.headers["location"]
    with open_store(str(stores["own"])) as store:
        current = store.records.suspension(key)
    assert current is not None and current.resume is not None
    assert current.resume.by == "editor (Airflow)" and current.resume.reason == "urgent job done"


def test_the_page_resumes_a_pod_step_on_another_of_its_options(
        client: Any, stores: dict[str, Path]) -> None:
    """Issue 19 item 4: a suspended try that recorded its capacity options (a pod-based step
    with placement=) gets a placement choice on the page; the resume records it, a name that is
    not an option answers 409 with the names, and a suspend cannot name one."""
    import time

    from cairn.store import Key
    from cairn import open_store
    from cairn.store.outcomes import Outcome, OutcomeKind

    run_id = "manual__move"
    key = Key((MINE, TASK_ID, run_id, "-1"))
    with open_store(str(stores["own"])) as store:
        attempt = store.open_attempt(key)
        store.records.request_suspend(key, by="ops")
        store.records.record_outcome(key, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.SUSPENDED,
                                          started_at=time.time() - 5, ended_at=time.time(),
                                          option="l4-spot",
                                          options=("l4-spot", "l4-on-demand")))
    editor = _auth(client, "editor")
    page = client.get(f"/cairn/snapshots?{_query(run_id=run_id)}", headers=editor)
    assert '<select name="placement" id="placement">' in page.text
    assert '<option value="l4-on-demand">on l4-on-demand</option>' in page.text
    wrong = client.post(f"/cairn/api/snapshots/resume?{_query(run_id=run_id)}",
                        headers=editor, json={"placement": "h100"})
    assert wrong.status_code == 409
    assert "capacity options (l4-spot, l4-on-demand)" in wrong.json()["detail"]
    suspend = client.post(f"/cairn/api/snapshots/suspend?{_query(run_id=run_id)}",
                          headers=editor, json={"placement": "l4-on-demand"})
    assert suspend.status_code == 422
    form = client.post(f"/cairn/snapshots/resume?{_query(run_id=run_id)}", headers=editor,
                       data={"reason": "spot is scarce", "placement": "l4-on-demand"},
                       follow_redirects=False)
    assert form.status_code == 303, form.text
    with open_store(str(stores["own"])) as store:
        current = store.records.suspension(key)
    assert current is not None and current.resume is not None
    assert (current.resume.by, current.resume.placement) == ("editor (Airflow)",
                                                             "l4-on-demand")
    page = client.get(f"/cairn/snapshots?{_query(run_id=run_id)}", headers=editor)
    assert 'id="placement"' not in page.text  # resumed: nothing left to choose
    assert "UTC, on l4-on-demand</span>" in page.text


def test_discard_needs_clear_access(client: Any, stores: dict[str, Path]) -> None:
    """Runs last: it removes DAG cairn_ui_mine's snapshots from its own store."""
    from cairn.store import Key
    from cairn import open_store

    url = f"/cairn/api/snapshots/discard?{_query()}"
    assert client.post(url, headers=_auth(client, "reader")).status_code == 403
    editor = _auth(client, "editor")
    assert client.post(f"/cairn/api/snapshots/discard?{_query(OTHER)}",
                       headers=editor).status_code == 403
    done = client.post(url, headers=editor)
    assert done.status_code == 200 and done.json()["snapshots_removed"] == 2
    with open_store(str(stores["own"])) as store:
        assert store.snapshots(Key((MINE, TASK_ID, RUN_ID, "-1"))) == []
        assert len(store.snapshots(Key((OTHER, TASK_ID, RUN_ID, "-1")))) == 1
