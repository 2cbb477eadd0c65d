"""Importing the provider pulls in neither torch nor CRIU helpers (scheduler and api-server
images have neither); plain ``import cairn_airflow`` does not even import Airflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DAGS = Path(__file__).resolve().parents[3] / "dags"
HEAVY = {"torch", "numpy", "cairn.state.checkpointer", "cairn.process", "cairn.process.criu"}


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    # No import timeout: Airflow gives a DAG file 30 s to import, which a machine running the
    # other suites may exceed; this checks what is imported, not how fast.
    env = {**os.environ, "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "0"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return set(json.loads(run.stdout.strip().splitlines()[-1]))


def test_import_cairn_airflow_imports_neither_airflow_nor_torch() -> None:
    loaded = _modules_after("import cairn_airflow\ncairn_airflow.get_provider_info()")
    assert "cairn_airflow" in loaded
    assert not {"airflow", *HEAVY} & loaded


def test_provider_modules_and_example_dags_import_no_torch_or_criu() -> None:
    loaded = _modules_after(
        "import cairn_airflow.hooks, cairn_airflow.operators, cairn_airflow.decorators\n"
        "import cairn_airflow.command\n"
        "from airflow.sdk import task\n"
        "assert task.cairn is cairn_airflow.cairn_task\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(DAGS)!r})\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "assert bag.dags\n")
    assert {"cairn_airflow.decorators", "airflow.sdk"} <= loaded
    assert not HEAVY & loaded
