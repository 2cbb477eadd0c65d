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
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
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


@pytest.fixture(scope="module")
def browser(open_chromium: Callable[[str], AbstractContextManager[Any]]) -> Iterator[Any]:
    """Headless Chromium; skips, before any server starts, when it, selenium or the FAB
    provider is missing."""
    pytest.importorskip("airflow.providers.fab.auth_manager.fab_auth_manager")
    with open_chromium("1280,1000") as browser:
        yield browser


@pytest.fixture(scope="module")
def fab_server(browser: Any, airflow_db: Path, tmp_path_factory: pytest.TempPathFactory,
               serve_api: Callable[..., AbstractContextManager[str]],
               write_snapshots: Callable[..., None],
               sync_dags: Callable[..., None]) -> Iterator[dict[str, Any]]:
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
    sync_dags(_dag(MINE), _dag(OTHER))
    write_snapshots(str(own), (MINE, TASK_ID, RUN_ID, "-1"), b"own", 2)
    write_snapshots(str(own), (OTHER, TASK_ID, RUN_ID, "-1"), b"other-dag", 1)
    write_snapshots(str(team_b), (MINE, TASK_ID, RUN_ID, "-1"), b"team-b-secret", 3)

    _airflow(env, ["fab-db", "migrate"], ["sync-perm", "--include-dags"],
             ["roles", "create", ROLE],
             ["roles", "add-perms", ROLE, "-r", f"DAG:{MINE}", "DAG Runs", "Task Instances",
              "-a", "can_read"],
             ["users", "create", "--username", USER, "--password", PASSWORD, "--role", ROLE,
              "--email", "onedag@example.com", "--firstname", "One", "--lastname", "Dag"])

    log_path = root / "api-server.log"
    with serve_api(env, log_path, timeout=180) as base:
        yield {"base": base, "team_b": team_b, "own": own, "log": log_path}


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
