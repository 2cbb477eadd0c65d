"""The snapshots page of a real ``@task.cairn`` run, behind Airflow's real authentication.

One DAG run per module (``dag.test()``, SQLite, torch): try 1 trains, snapshots every 5 steps
and crashes after step 14; try 2 resumes after step 14 and finishes (``keep_snapshots=True``
keeps the snapshots to show). Then:

- in-process, a FastAPI app with Airflow's own ``init_plugins`` (the plugin mounted through
  its ``airflow.plugins`` entry point) and ``init_auth_manager`` (the Simple auth manager, users
  from the environment, its ``/auth/token`` login), driven with FastAPI's TestClient;
- a real ``airflow api-server`` process, and the page opened in Debian's headless Chromium
  through selenium after logging in on Airflow's login form; a screenshot is saved to
  ``providers/cairn_airflow/test-artifacts/cairn_snapshots.png``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest

pytestmark = pytest.mark.slow

TOTAL, EVERY, CRASH_AFTER = 25, 5, 14
DAG_ID, TASK_ID = "cairn_ui_train", "train"
PASSWORDS = {"admin": "admin-pw", "viewer": "viewer-pw", "nobody": "nobody-pw"}
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
ARTIFACT = ARTIFACTS / "cairn_snapshots.png"  # the page itself
ARTIFACT_IN_AIRFLOW = ARTIFACTS / "cairn_snapshots_in_airflow.png"  # the task instance's tab


@dataclass(frozen=True)
class Run:
    run_id: str
    store: Path
    env: dict[str, str]

    @property
    def query(self) -> str:
        return urlencode({"dag_id": DAG_ID, "task_id": TASK_ID, "run_id": self.run_id,
                          "map_index": -1})


def _training_dag():  # noqa: ANN202 - an Airflow DAG
    from airflow.sdk import DAG, task

    with DAG(DAG_ID, schedule=None) as dag:
        # Inline persistence: no writer process to start (the page does not care how).
        @task.cairn(task_id=TASK_ID, every_steps=EVERY, retries=1,
                    retry_delay=timedelta(seconds=1), keep_snapshots=True,
                    checkpointer_options={"persist": "inline"})
        def train(ckpt, ti=None):
            import torch

            torch.manual_seed(0)
            frozen = torch.nn.Linear(256, 256)  # never trained: deduplicated between snapshots
            frozen.requires_grad_(False)
            head = torch.nn.Linear(256, 1)
            opt = torch.optim.SGD(head.parameters(), lr=0.01)
            start = ckpt.restore(models={"frozen": frozen, "head": head}, optimizer=opt)
            for step in range(start, TOTAL):
                x = torch.randn(8, 256)
                loss = head(frozen(x)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step(step)
                if ti.try_number == 1 and step == CRASH_AFTER:
                    raise RuntimeError(f"simulated crash after step {step}")
            return {"start": start}

        train()
    return dag


@pytest.fixture(scope="module")
def run(airflow_db: Path, tmp_path_factory: pytest.TempPathFactory,
        sync_dags: Callable[..., None]) -> Iterator[Run]:
    """The DAG run, the store it wrote, and the environment of an authenticated Airflow."""
    import torch

    root = tmp_path_factory.mktemp("cairn-ui")
    store = root / "cairn-store"
    passwords = root / "passwords.json"
    passwords.write_text(json.dumps(PASSWORDS))
    env = {
        "AIRFLOW_CONN_CAIRN_DEFAULT": json.dumps({"conn_type": "cairn",
                                                  "extra": {"store_url": str(store)}}),
        # The default auth manager (Simple): "nobody" has no role, so no DAG access.
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer,nobody:",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__API_AUTH__JWT_SECRET": "cairn-ui-test-" + "0123456789abcdef" * 4,  # >= 64 bytes
        # Connections a query's conn_id may name besides the task's own (issue 15).
        "AIRFLOW__CAIRN__UI_CONN_IDS": "cairn_ui_db,cairn_ui_pg",
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        dag = _training_dag()
        sync_dags(dag)
        dag_run = dag.test()
        torch.set_num_threads(threads)
        assert dag_run.state == "success"
        yield Run(run_id=dag_run.run_id, store=store, env=env)


@pytest.fixture(scope="module")
def client(run: Run) -> Iterator[Any]:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from airflow.api_fastapi.app import init_auth_manager, init_plugins

    app = FastAPI()
    init_plugins(app)
    init_auth_manager(app)
    with TestClient(app) as client:
        yield client


def _token(client: Any, user: str) -> str:
    response = client.post("/auth/token", json={"username": user, "password": PASSWORDS[user]})
    assert response.status_code == 201, response.text
    return response.json()["access_token"]


def test_anonymous_and_unauthorized_requests_are_refused(client: Any, run: Run) -> None:
    page = client.get(f"/cairn/snapshots?{run.query}")
    assert page.status_code == 401
    assert 'id="refused"' in page.text and "Not authenticated" in page.text
    assert "snapshot-row" not in page.text and run.run_id not in page.text
    api = client.get(f"/cairn/api/snapshots?{run.query}")
    assert api.status_code == 401 and api.json() == {"detail": "Not authenticated"}

    forged = client.get(f"/cairn/api/snapshots?{run.query}",
                        headers={"Authorization": "Bearer not-a-jwt"})
    assert forged.status_code == 403 and "snapshots" not in forged.json()

    nobody = {"Authorization": f"Bearer {_token(client, 'nobody')}"}
    denied = client.get(f"/cairn/api/snapshots?{run.query}", headers=nobody)
    assert denied.status_code == 403 and denied.json() == {"detail": "Forbidden"}
    denied_page = client.get(f"/cairn/snapshots?{run.query}", headers=nobody)
    assert denied_page.status_code == 403 and "may not read" in denied_page.text


def test_the_api_reports_the_runs_snapshots_and_its_resume(client: Any, run: Run) -> None:
    from cairn.store import Key
    from cairn import open_store

    headers = {"Authorization": f"Bearer {_token(client, 'viewer')}"}
    response = client.get(f"/cairn/api/snapshots?{run.query}", headers=headers)
    assert response.status_code == 200, response.text
    report = response.json()
    key = Key((DAG_ID, TASK_ID, run.run_id, "-1"))
    assert report["key"] == str(key) and report["state"] == "active"
    # Readers see which connection, never the store's URL (issue 15).
    assert report["store"] == "connection cairn_default" and str(run.store) not in response.text
    with open_store(str(run.store)) as store:
        expected = [(i.seq, i.manifest.step, i.manifest.bytes_written)
                    for i in store.snapshots(key)]
    assert [(s["seq"], s["step"], s["bytes_written"]) for s in report["snapshots"]] == expected
    assert [s["step"] for s in report["snapshots"]] == [24, 19, 14]
    assert all(s["status"] == "present" for s in report["snapshots"])
    # The frozen layer is deduplicated: later snapshots write less than their size.
    assert all(s["dedup_ratio"] is None or s["dedup_ratio"] > 1 for s in report["snapshots"][:2])
    first, second = report["tries"]
    assert first["resumed_from"] is None and first["last_step"] == CRASH_AFTER
    assert second["resumed_step"] == CRASH_AFTER and second["steps_saved"] == CRASH_AFTER + 1
    assert (first["airflow_try"], second["airflow_try"]) == (1, 2)
    assert second["airflow_state"] == "success"
    assert report["steps_saved"] == CRASH_AFTER + 1


def test_the_page_and_deep_verify(client: Any, run: Run) -> None:
    headers = {"Authorization": f"Bearer {_token(client, 'viewer')}"}
    page = client.get(f"/cairn/snapshots?{run.query}", cookies=None, headers=headers)
    assert page.status_code == 200
    assert page.text.count('class="snapshot-row"') == 3
    assert page.text.count('class="try-row"') == 2
    assert f"{CRASH_AFTER + 1} steps not redone" in page.text
    assert f'href="/cairn/api/snapshots?{run.query}"' in page.text.replace("&amp;", "&")
    assert f'action="/cairn/snapshots/discard?{run.query}"' in page.text.replace("&amp;", "&")

    assert str(run.store) not in page.text

    # A full read of every snapshot needs the permission to edit the DAG, once per interval.
    refused = client.get(f"/cairn/api/snapshots?{run.query}&verify=deep", headers=headers)
    assert refused.status_code == 403, refused.text
    admin = {"Authorization": f"Bearer {_token(client, 'admin')}"}
    deep = client.get(f"/cairn/api/snapshots?{run.query}&verify=deep", headers=admin).json()
    assert deep["deep_verified"] and {s["status"] for s in deep["snapshots"]} == {"verified"}
    again = client.get(f"/cairn/api/snapshots?{run.query}&verify=deep", headers=admin)
    assert again.status_code == 429 and int(again.headers["retry-after"]) > 0
    assert "deep-verified less than" in again.json()["detail"]


# -- a real api-server and a real browser --------------------------------------------------------

@pytest.fixture(scope="module")
def api_server(run: Run, tmp_path_factory: pytest.TempPathFactory,
               serve_api: Callable[..., AbstractContextManager[str]]) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("api-server") / "api-server.log"
    with serve_api({**os.environ, **run.env}, log_path, timeout=120) as base:
        yield base


@pytest.fixture(scope="module")
def browser(open_chromium: Callable[[str], AbstractContextManager[Any]]) -> Iterator[Any]:
    """Headless Chromium; skips, before any server starts, when it or selenium is missing."""
    with open_chromium("1280,1100") as browser:
        yield browser


def test_a_browser_logs_in_and_sees_the_snapshots(browser: Any, api_server: str,
                                                  run: Run) -> None:
    import httpx

    page_path = f"/cairn/snapshots?{run.query}"
    anonymous = httpx.get(api_server + page_path)
    assert anonymous.status_code == 401 and 'id="refused"' in anonymous.text
    assert "snapshot-row" not in anonymous.text
    anonymous_api = httpx.get(f"{api_server}/cairn/api/snapshots?{run.query}")
    assert anonymous_api.status_code == 401
    assert anonymous_api.json() == {"detail": "Not authenticated"}

    # The extra link, as Airflow's own REST API gives it for the task instance.
    token = httpx.post(f"{api_server}/auth/token",
                       json={"username": "viewer", "password": PASSWORDS["viewer"]})
    assert token.status_code == 201, token.text
    links = httpx.get(f"{api_server}/api/v2/dags/{DAG_ID}/dagRuns/{run.run_id}/taskInstances/"
                      f"{TASK_ID}/links",
                      headers={"Authorization": f"Bearer {token.json()['access_token']}"})
    assert links.status_code == 200, links.text
    assert links.json()["extra_links"] == {"cairn snapshots": page_path}

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(api_server + page_path)
    assert browser.find_element(By.ID, "refused").text.startswith("401")

    browser.get(f"{api_server}/auth/login?{urlencode({'next': page_path})}")
    wait = WebDriverWait(browser, 60)
    wait.until(ec.presence_of_element_located((By.NAME, "username")))
    browser.find_element(By.NAME, "username").send_keys("viewer")
    browser.find_element(By.NAME, "password").send_keys(PASSWORDS["viewer"])
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(ec.presence_of_element_located((By.ID, "snapshots")))

    assert browser.find_element(By.TAG_NAME, "h1").text == \
        f"cairn snapshots: {DAG_ID} / {TASK_ID}"
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.snapshot-row")
    assert [r.find_elements(By.TAG_NAME, "td")[2].text for r in rows] == ["24", "19", "14"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.try-row")) == 2
    assert f"{CRASH_AFTER + 1} steps" in browser.find_element(By.ID, "saved").text
    assert browser.find_element(By.ID, "progress-chart").is_displayed()
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, int(height) + 200)  # the window's frame takes some height
    assert browser.save_screenshot(str(ARTIFACT))
    print(f"screenshot: {ARTIFACT}")

    # The external view: Airflow's task instance page shows the page in a sandboxed iframe
    # (no scripts), with DAG_ID/RUN_ID/TASK_ID filled in by the UI.
    browser.set_window_size(1400, 1000)
    browser.get(f"{api_server}/dags/{DAG_ID}/runs/{quote(run.run_id, safe='')}/tasks/"
                f"{TASK_ID}/plugin/cairn-snapshots")
    frame = wait.until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, "iframe[title='cairn snapshots']")))
    browser.switch_to.frame(frame)
    wait.until(ec.presence_of_element_located((By.ID, "snapshots")))
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.snapshot-row")) == 3
    browser.switch_to.default_content()
    assert browser.save_screenshot(str(ARTIFACT_IN_AIRFLOW))
    print(f"screenshot: {ARTIFACT_IN_AIRFLOW}")


def test_a_browser_suspends_and_resumes_a_running_step(
        browser: Any, api_server: str, run: Run,
        write_snapshots: Callable[..., None]) -> None:
    """Issue 19: the page's Suspend and Resume buttons (forms: the iframe runs no scripts) for
    a try still running, as an admin (who may clear the task); the page then shows who asked,
    when and why."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from cairn.store import Key
    from cairn import open_store
    from cairn.store.outcomes import Outcome, OutcomeKind

    run_id = "manual__suspend-ui"
    write_snapshots(str(run.store), (DAG_ID, TASK_ID, run_id, "-1"), b"running", 2)
    query = urlencode({"dag_id": DAG_ID, "task_id": TASK_ID, "run_id": run_id,
                       "map_index": -1})
    page_path = f"/cairn/snapshots?{query}"
    browser.delete_all_cookies()
    browser.get(f"{api_server}/auth/login?{urlencode({'next': page_path})}")
    wait = WebDriverWait(browser, 60)
    wait.until(ec.presence_of_element_located((By.NAME, "username")))
    browser.find_element(By.NAME, "username").send_keys("admin")
    browser.find_element(By.NAME, "password").send_keys(PASSWORDS["admin"])
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(ec.presence_of_element_located((By.ID, "suspend")))

    browser.find_element(By.CSS_SELECTOR, "#suspend-form input[name=reason]").send_keys(
        "an urgent job needs the GPUs")
    browser.find_element(By.ID, "suspend").click()
    wait.until(ec.presence_of_element_located((By.ID, "resume")))
    assert browser.find_element(By.ID, "suspend-state").text == "suspend-requested"
    asked = browser.find_element(By.ID, "suspend-by").text
    assert asked.startswith("asked by admin (Airflow) at ") and \
        asked.endswith("UTC (an urgent job needs the GPUs)")
    assert browser.find_elements(By.ID, "suspend") == []
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "cairn_snapshots_suspend.png"))

    browser.find_element(By.ID, "resume").click()
    wait.until(ec.presence_of_element_located((By.ID, "resume-by")))
    assert browser.find_element(By.ID, "resume-by").text.startswith(
        "resume asked by admin (Airflow)")
    with open_store(str(run.store)) as store:
        current = store.records.suspension(Key((DAG_ID, TASK_ID, run_id, "-1")))
    assert current is not None and current.state.value == "resume-requested"
    assert current.suspend.reason == "an urgent job needs the GPUs"
    assert browser.find_elements(By.ID, "placement") == []  # a worker step: nothing to choose

    # A pod-based step whose suspended try recorded its capacity options (issue 19 item 4):
    # the resume form offers them, and the chosen one is what the resume request names.
    moved_id = "manual__move-ui"
    moved_key = Key((DAG_ID, TASK_ID, moved_id, "-1"))
    with open_store(str(run.store)) as store:
        attempt = store.open_attempt(moved_key)
        store.records.request_suspend(moved_key, by="ops")
        store.records.record_outcome(moved_key, Outcome(
            epoch=attempt.epoch, outcome=OutcomeKind.SUSPENDED, started_at=time.time() - 5,
            ended_at=time.time(), option="l4-spot", options=("l4-spot", "l4-on-demand")))
    browser.get(f"{api_server}/cairn/snapshots?" + urlencode(
        {"dag_id": DAG_ID, "task_id": TASK_ID, "run_id": moved_id, "map_index": -1}))
    wait.until(ec.presence_of_element_located((By.ID, "placement")))
    Select(browser.find_element(By.ID, "placement")).select_by_value("l4-on-demand")
    browser.find_element(By.ID, "resume").click()
    wait.until(ec.presence_of_element_located((By.ID, "resume-by")))
    with open_store(str(run.store)) as store:
        moved = store.records.suspension(moved_key)
    assert moved is not None and moved.resume is not None
    assert (moved.resume.by, moved.resume.placement) == ("admin (Airflow)", "l4-on-demand")


def test_a_connection_from_the_metadata_db_and_a_foreign_one(client: Any, run: Run) -> None:
    """The api-server reads allow-listed connections from its DB (not only the environment),
    refuses a connection of another type without repeating its host, and any other one."""
    from airflow.models.connection import Connection
    from airflow.utils.session import create_session

    with create_session() as session:
        session.add(Connection(conn_id="cairn_ui_db", conn_type="cairn",
                               extra=json.dumps({"store_url": str(run.store)})))
        session.add(Connection(conn_id="cairn_ui_pg", conn_type="postgres",
                               host="secret-db.internal"))
    headers = {"Authorization": f"Bearer {_token(client, 'viewer')}"}
    from_db = client.get(f"/cairn/api/snapshots?{run.query}&conn_id=cairn_ui_db",
                         headers=headers)
    assert from_db.status_code == 200, from_db.text
    assert [s["step"] for s in from_db.json()["snapshots"]] == [24, 19, 14]
    foreign = client.get(f"/cairn/api/snapshots?{run.query}&conn_id=cairn_ui_pg",
                         headers=headers)
    assert foreign.status_code == 400 and "not a cairn connection" in foreign.text
    assert "secret-db" not in foreign.text
    # Not the task's connection and not allow-listed: refused, whatever it names.
    forged = client.get(f"/cairn/api/snapshots?{run.query}&conn_id=nope", headers=headers)
    assert forged.status_code == 403 and "not the one this task uses" in forged.text


def test_discarding_needs_edit_access_and_a_same_origin_form(client: Any, run: Run) -> None:
    """Runs last: it removes the module's snapshots."""
    from cairn.store import Key
    from cairn import open_store

    discard_api = f"/cairn/api/snapshots/discard?{run.query}"
    assert client.post(discard_api).status_code == 401
    viewer = {"Authorization": f"Bearer {_token(client, 'viewer')}"}
    refused = client.post(discard_api, headers=viewer)
    assert refused.status_code == 403 and refused.json() == {"detail": "Forbidden"}
    admin_cookie = {"_token": _token(client, "admin")}
    client.cookies.update(admin_cookie)
    try:
        cross = client.post(f"/cairn/snapshots/discard?{run.query}",
                            headers={"Origin": "http://elsewhere.example"}, follow_redirects=False)
        assert cross.status_code == 403 and "elsewhere.example" in cross.text
        with open_store(str(run.store)) as store:
            assert len(store.snapshots(Key((DAG_ID, TASK_ID, run.run_id, "-1")))) == 3
        done = client.post(f"/cairn/snapshots/discard?{run.query}",
                           headers={"Origin": "http://testserver"}, follow_redirects=False)
        assert done.status_code == 303
        assert done.headers["location"] == f"/cairn/snapshots?{run.query}&discarded=3"
        page = client.get(done.headers["location"])
        assert page.status_code == 200 and 'id="discarded"' in page.text
        assert 'id="state">done<' in page.text and "snapshot-row" not in page.text
        tries = client.get(f"/cairn/api/snapshots?{run.query}").json()["tries"]
        assert [(t["mode"], t["ended"], t["steps_saved"]) for t in tries][-1] == \
            ("discard", "removed", None)
        assert len(tries) == 3 and tries[-1]["resumed_from"] is None  # the discard resumed nothing
    finally:
        client.cookies.clear()
    with open_store(str(run.store)) as store:
        assert store.snapshots(Key((DAG_ID, TASK_ID, run.run_id, "-1"))) == []
