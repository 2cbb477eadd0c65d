"""The k8s integration tests' ``cairn run`` steps run in their test's directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _step_runs_in_tmp_path(request: pytest.FixtureRequest, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    # CairnRun starts the step in the current directory: there, the files the workloads append
    # to (under tmp_path) are inside the working directory, a track root (issue 15), as a
    # pod's files are under its image's WORKDIR or a declared CAIRN_TRACK_ROOTS.
    if "CairnRun" in vars(request.module):
        monkeypatch.chdir(tmp_path)
