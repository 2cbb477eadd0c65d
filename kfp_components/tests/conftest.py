from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


@pytest.fixture
def local_kfp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """kfp.local with SubprocessRunner on this interpreter; returns the pipeline root. The
    task processes inherit PYTHONPATH with this directory (for ``kfp_workloads``)."""
    from kfp import local

    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    root = tmp_path / "pipeline-root"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    return root


@pytest.fixture(scope="session", autouse=True)
def committed_marks(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where tries record the newest seq they committed (ADR 0049): this session's directory,
    in the environment so the processes the tests start use it too, never ~/.cache."""
    path = str(tmp_path_factory.mktemp("committed-marks"))
    os.environ["CAIRN_COMMITTED_DIR"] = path
    return path
