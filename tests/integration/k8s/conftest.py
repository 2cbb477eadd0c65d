"""The k8s integration tests' ``cairn run`` steps run in their test's directory; the shared
volume of a pod whose containers run as different users."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cairn.k8s.transform import SIDECAR_UID
from tests.integration.k8s.fakes import JOB, FakeKubernetesAPI, serve


@pytest.fixture(autouse=True)
def _step_runs_in_tmp_path(request: pytest.FixtureRequest, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    # CairnRun starts the step in the current directory: there, the files the workloads append
    # to (under tmp_path) are inside the working directory, a track root (issue 15), as a
    # pod's files are under its image's WORKDIR or a declared CAIRN_TRACK_ROOTS.
    if "CairnRun" in vars(request.module):
        monkeypatch.chdir(tmp_path)


@pytest.fixture()
def volume() -> Iterator[Path]:
    """A pod's shared volume as the kubelet makes an ``emptyDir`` for the pod's ``fsGroup``
    (the sidecar's group): group 65532, setgid, mode 2777."""
    # Not under pytest's tmp_path: its parents are 0700, which the other users cannot cross.
    path = Path(tempfile.mkdtemp(prefix="cairn-volume-", dir="/tmp"))
    try:
        os.chown(path, 0, SIDECAR_UID)
        os.chmod(path, 0o2777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def fake_api(tmp_path: Path) -> Iterator[tuple[FakeKubernetesAPI, Path]]:
    """The fake API server (a fake: no Kubernetes API server runs here) serving the running Job
    ``ml/train``, and the file holding its service-account token."""
    api = FakeKubernetesAPI()
    api.jobs[JOB] = False
    token = tmp_path / "token"
    token.write_text(api.token)
    with serve(api):
        yield api, token
