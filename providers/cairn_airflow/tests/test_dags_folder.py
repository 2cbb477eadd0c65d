"""Every file in ``dags/`` imports without errors (DagBag, as the dag-processor parses it)."""

from __future__ import annotations

from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[3] / "dags"
FILES = sorted(p for p in DAGS.glob("*.py") if not p.name.startswith("_"))


def test_the_dags_folder_has_dags() -> None:
    assert FILES, f"no DAG files in {DAGS}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_dag_file_imports_without_errors(path: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(path))
    assert not bag.import_errors, bag.import_errors
    assert bag.dags, f"{path.name} defines no DAG"
    for dag in bag.dags.values():
        dag.validate()
