"""Issue 15 in a real browser with Airflow's FAB auth manager (``apache-airflow-providers-fab``):
a user whose role may read one DAG only logs in on FAB's own form, then in headless Chromium
that DAG's snapshots page works, another DAG's page answers 403 and a forged ``conn_id`` (a real
``cairn`` connection to another team's store) is refused without a word of that store.

The role is made with Airflow's own CLI (``roles create``, ``roles add-perms``: read on
``DAG:cairn_fab_mine``, its DAG runs and task instances), the user with ``users create``, and a
real ``airflow api-server`` serves both the FAB login and the plugin.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

pytestmark = pytest.mark.slow

FAB = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"
MINE, OTHER, TASK_ID, RUN_ID = "cairn_fab_mine", "cairn_fab_other", "train", "manual__fab"
ROLE, USER, PASSWORD = "cairn_one_dag", "onedag", "onedag-pw-1"


def _dag(dag_id: str) -> Any:
    from airflow.sdk import DAG

    from cairn_airflow.operators import CairnPythonOperator

    with DAG(dag_id, schedule=None) as dag:
        CairnPythonOperator(task_id=TASK_ID, python_callable=lambda ckpt: None)
    return dag


def _snapshots(store_url: str, dag_id: str, marker: bytes, count: int) -> None:
    from cairn.store import Key, SnapshotMode, open_store

    with open_store(store_url) as store:
        attempt = store.open_attempt(Key((dag_id, TASK_ID, RUN_ID, "-1")), note={"mode": "state"})
        for step in range(count):
            with attempt.snapshot(mode=SnapshotMode.STATE) as snap:
                snap.add_bytes("state.bin", marker * (step + 1))
                snap.commit(step=step)


# Airflow's own CLI commands, run in one interpreter (each `airflow` start costs seconds).
_CLI = """
import sys
from airflow.cli import cli_parser
parser = cli_parser.get_parser()
for argv in __import__("json").loads(sys.argv[1]):
    args = parser.parse_args(argv)
    args.func(args)
"""


def _airflow(env: dict[str, str], *commands: list[str]) -> None:
    result = subprocess.run([sys.executable, "-c", _CLI, json.dumps(commands)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"airflow {commands}:\n{result.stdout[-2000:]}\n" \
                                   f"{result.stderr[-3000:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium (Debian's, with its chromedriver); skips, before any server starts,
    when it, selenium or the FAB provider is missing."""
    pytest.importorskip("airflow.providers.fab.auth_manager.fab_auth_manager")
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Debian's chromium and chromium-driver are not installed: run "
                    "scripts/install_chromium.sh")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture(scope="module")
def fab_server(browser: Any, airflow_db: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import httpx

    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.collection import update_dag_parsing_results_in_db
    from airflow.serialization.serialized_objects import LazyDeserializedDAG
    from airflow.utils.session import create_session

    root = tmp_path_factory.mktemp("cairn-fab")
    own, team_b = root / "store-own", root / "store-team-b"
    env = {
        **os.environ,
        "AIRFLOW_CONN_CAIRN_DEFAULT": json.dumps({"conn_type": "cairn",
                                                  "extra": {"store_url": str(own)}}),
        "AIRFLOW_CONN_TEAM_B": json.dumps({"conn_type": "cairn",
                                           "extra": {"store_url": str(team_b)}}),
        "AIRFLOW__CORE__AUTH_MANAGER": FAB,
        "AIRFLOW__API_AUTH__JWT_SECRET": "cairn-fab-test-" + "0123456789abcdef" * 4,
        "AIRFLOW__API__SECRET_KEY": "cairn-fab-test-secret-key",
    }
    with create_session() as session:
        DagBundlesManager().sync_bundles_to_db(session=session)
        session.flush()
        update_dag_parsing_results_in_db(
            "dags-folder", None, [LazyDeserializedDAG.from_dag(_dag(d)) for d in (MINE, OTHER)],
            {}, None, set(), session=session)
    _snapshots(str(own), MINE, b"own", 2)
    _snapshots(str(own), OTHER, b"other-dag", 1)
    _snapshots(str(team_b), MINE, b"team-b-secret", 3)

    _airflow(env, ["fab-db", "migrate"], ["sync-perm", "--include-dags"],
             ["roles", "create", ROLE],
             ["roles", "add-perms", ROLE, "-r", f"DAG:{MINE}", "DAG Runs", "Task Instances",
              "-a", "can_read"],
             ["users", "create", "--username", USER, "--password", PASSWORD, "--role", ROLE,
              "--email", "onedag@example.com", "--firstname", "One", "--lastname", "Dag"])

    port = _free_port()
    log_path = root / "api-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "airflow", "api-server", "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"api-server exited {proc.returncode}:\n"
                                   f"{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"api-server not healthy:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"base": base, "team_b": team_b, "own": own, "log": log_path}
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _page(dag_id: str, **extra: str) -> str:
    query = urlencode({"dag_id": dag_id, "task_id": TASK_ID, "run_id": RUN_ID, "map_index": -1,
                       **extra})
    return f"/cairn/snapshots?{query}"


def test_a_one_dag_user_sees_that_dag_only(browser: Any, fab_server: dict[str, Any]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    base = fab_server["base"]
    wait = WebDriverWait(browser, 60)
    browser.get(f"{base}/auth/login/?{urlencode({'next': _page(MINE)})}")
    wait.until(ec.presence_of_element_located((By.NAME, "username")))
    browser.find_element(By.NAME, "username").send_keys(USER)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit], button[type=submit]").click()
    wait.until(lambda b: b.get_cookie("_token") is not None)

    browser.get(base + _page(MINE))
    wait.until(ec.presence_of_element_located((By.ID, "snapshots")))
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.snapshot-row")) == 2
    assert str(fab_server["own"]) not in browser.page_source  # the store URL is never shown

    browser.get(base + _page(OTHER))
    refused = wait.until(ec.presence_of_element_located((By.ID, "refused")))
    assert refused.text.startswith("403"), refused.text
    assert not browser.find_elements(By.CSS_SELECTOR, "tr.snapshot-row")

    browser.get(base + _page(MINE, conn_id="team_b"))
    refused = wait.until(ec.presence_of_element_located((By.ID, "refused")))
    assert refused.text.startswith("403") and "not the one this task uses" in refused.text
    assert str(fab_server["team_b"]) not in browser.page_source
    assert not browser.find_elements(By.CSS_SELECTOR, "tr.snapshot-row")

    browser.get(base + _page(MINE, verify="deep"))  # reading is not editing
    refused = wait.until(ec.presence_of_element_located((By.ID, "refused")))
    assert refused.text.startswith("403"), refused.text
