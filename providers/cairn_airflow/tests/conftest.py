"""An Airflow 3 home for the provider's tests: a temporary AIRFLOW_HOME with SQLite.

The environment is set when this module is imported, before any test imports Airflow (which
reads its configuration once, at import). ``airflow db migrate`` runs once per session, in a
subprocess, and only for the tests that ask for ``airflow_db``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
DAGS = REPO / "dags"

_HOME = Path(tempfile.mkdtemp(prefix="cairn-airflow-home-"))
(_HOME / "dags").mkdir()
os.environ.update({
    "AIRFLOW_HOME": str(_HOME),
    "AIRFLOW__CORE__DAGS_FOLDER": str(_HOME / "dags"),  # empty: dag.test() re-parses it each run
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_HOME}/airflow.db",
    "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
    "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
})
for _name in [n for n in os.environ if n.startswith("AIRFLOW_CONN_") or n.startswith("CAIRN_")]:
    del os.environ[_name]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def airflow_db(airflow_home: Path) -> Path:
    """The migrated metadata DB (``airflow db migrate``, once per session)."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=os.environ.copy(),
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"airflow db migrate: {time.monotonic() - started:.1f}s")
    return airflow_home / "airflow.db"


@pytest.fixture()
def cairn_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh local store, named by the ``cairn_default`` connection (an env connection)."""
    store = tmp_path / "cairn-store"
    monkeypatch.setenv("AIRFLOW_CONN_CAIRN_DEFAULT",
                       f'{{"conn_type": "cairn", "extra": {{"store_url": "{store}"}}}}')
    return store


def _sync_dags(*dags: Any) -> None:
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.collection import update_dag_parsing_results_in_db
    from airflow.serialization.serialized_objects import LazyDeserializedDAG
    from airflow.utils.session import create_session

    with create_session() as session:
        DagBundlesManager().sync_bundles_to_db(session=session)
        session.flush()
        update_dag_parsing_results_in_db("dags-folder", None,
                                         [LazyDeserializedDAG.from_dag(dag) for dag in dags], {},
                                         None, set(), session=session)


@pytest.fixture(scope="session")
def sync_dags(airflow_db: Path) -> Callable[..., None]:
    """``sync_dags(*dags)``: write DAGs built in a test to the metadata DB, as the
    dag-processor does for DAG files."""
    return _sync_dags


class AirflowRunner:
    """Runs DAGs built in tests with ``dag.test()`` and reads back what they left."""

    def sync(self, dag: Any) -> None:
        """Write a DAG built in a test to the metadata DB (what the dag-processor does for a
        DAG file), so that ``dag.test()`` finds its serialized version."""
        _sync_dags(dag)

    def run(self, dag: Any, **kwargs: Any) -> Any:
        """``dag.test()`` after syncing the DAG; returns the finished DagRun."""
        self.sync(dag)
        return dag.test(**kwargs)

    def task_instances(self, dag_run: Any) -> dict[str, Any]:
        from airflow.utils.session import create_session

        with create_session() as session:
            return {ti.task_id: ti for ti in dag_run.get_task_instances(session=session)}

    def xcom(self, dag_run: Any, task_id: str, key: str = "return_value") -> Any:
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session

        with create_session() as session:
            row = session.scalars(XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id,
                                                     task_ids=task_id, key=key)).first()
            return None if row is None else XComModel.deserialize_value(row)


@pytest.fixture()
def airflow(airflow_db: Path) -> AirflowRunner:
    return AirflowRunner()


@pytest.fixture()
def one_thread() -> Iterator[None]:
    """Keep torch to one thread in the test process (the machine's cores are shared)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- Kubernetes: no API server runs here --------------------------------------------------------

_KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{{name: none, cluster: {{server: "{server}"}}}}]
users: [{{name: none, user: {{token: unused}}}}]
contexts: [{{name: none, context: {{cluster: none, user: none}}}}]
current-context: none
"""
NO_SERVER = "https://127.0.0.1:9"  # nothing listens: building a pod must not need the API


@pytest.fixture()
def kubeconfig_for(tmp_path: Path) -> Any:
    """``kubeconfig_for(url)``: the path of a kubeconfig naming the API server at ``url`` (a
    fake one a test started, or :data:`NO_SERVER`)."""
    def write(server: str) -> str:
        path = tmp_path / f"kubeconfig-{abs(hash(server))}"
        path.write_text(_KUBECONFIG.format(server=server))
        return str(path)

    return write


@pytest.fixture()
def kubeconfig(kubeconfig_for: Any) -> str:
    return kubeconfig_for(NO_SERVER)


@pytest.fixture()
def store_url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


# -- the snapshots page: its snapshots, a real api-server, a real browser -----------------------

def _write_snapshots(store_url: str, key: tuple[str, str, str, str], marker: bytes,
                     count: int) -> None:
    from cairn.store import Key, SnapshotMode
    from cairn import open_store

    with open_store(store_url) as store:
        attempt = store.open_attempt(Key(key), note={"mode": "state"})
        for step in range(count):
            with attempt.snapshot(mode=SnapshotMode.STATE) as snap:
                snap.add_bytes("state.bin", marker * (step + 1))
                snap.commit(step=step)


@pytest.fixture(scope="session")
def write_snapshots() -> Callable[[str, tuple[str, str, str, str], bytes, int], None]:
    """``write_snapshots(store_url, (dag, task, run, map_index), marker, count)``: one attempt
    of that key with ``count`` state snapshots (steps 0 on, ``marker`` repeated step+1 times)."""
    return _write_snapshots


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _api_server(env: dict[str, str], log_path: Path, *, timeout: float) -> Iterator[str]:
    import httpx

    port = _free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "airflow", "api-server", "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
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
        yield base
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@pytest.fixture(scope="session")
def serve_api() -> Callable[..., AbstractContextManager[str]]:
    """``with serve_api(env, log_path, timeout=S) as base:`` a real ``airflow api-server`` on
    a free port of 127.0.0.1 with ``env``, healthy within S seconds (or RuntimeError with its
    log), stopped after; ``base`` is its URL."""
    return _api_server


@contextmanager
def _chromium(window_size: str) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Debian's chromium and chromium-driver are not installed: run "
                    "scripts/install_chromium.sh")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={window_size}"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture(scope="session")
def open_chromium() -> Callable[[str], AbstractContextManager[Any]]:
    """``with open_chromium("1280,1000") as browser:`` Debian's headless Chromium (with its
    chromedriver) through selenium; skips when it or selenium is missing."""
    return _chromium


@pytest.fixture(scope="session", autouse=True)
def committed_marks(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where tries record the newest seq they committed (ADR 0049): this session's directory,
    in the environment so the processes the tests start use it too, never ~/.cache."""
    path = str(tmp_path_factory.mktemp("committed-marks"))
    os.environ["CAIRN_COMMITTED_DIR"] = path
    return path
