"""``cairn run`` exits 6 before starting its workload when the store cannot be reached
(ADR 0032): a stopped GCS server, a local store directory that cannot be made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.runtime import env
from cairn.runtime.exits import ExitCode
from tests.support.cairn_run import can_run_criu
from tests.support.stopped_gcs import EMULATOR, stopped_gcs_store

pytestmark = [pytest.mark.isolated, 
    pytest.mark.gcs,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]


def _cairn_run(store: str, key: str, marker: Path, tmp_path: Path,
               environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    workload = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ran')"]
    argv = [sys.executable, "-m", "cairn.cli.main", "run", "--store", store, "--key", key,
            "--every", "1s", "--workdir", str(tmp_path / "work"), "--", *workload]
    return subprocess.run(argv, env={**os.environ, **environ}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_cairn_run_exits_6_without_starting_when_gcs_is_unreachable(tmp_path: Path) -> None:
    marker = tmp_path / "workload-ran"
    with stopped_gcs_store() as stopped:  # the store holds a snapshot of the key
        done = _cairn_run(stopped.url, stopped.key, marker, tmp_path,
                                   {EMULATOR: stopped.endpoint,
                                    env.STORE_CONNECT_TIMEOUT.name: "2s"})
    assert done.returncode == ExitCode.STORAGE, done.stderr
    # The bounded first contact, not google-cloud-storage's 120 s retry, ended the try.
    assert f"{env.STORE_CONNECT_TIMEOUT.name}=2s bounds the wait" in done.stderr
    assert f"cannot reach the store {stopped.url}" in done.stderr
    assert "connection refused" in done.stderr and "reachable from this worker" in done.stderr
    assert not marker.exists()  # no fresh start
    assert "cairn run: started" not in done.stderr


def test_cairn_run_exits_6_when_the_local_store_cannot_be_made(tmp_path: Path) -> None:
    marker = tmp_path / "workload-ran"
    (tmp_path / "unmounted").write_text("")  # a file where the volume's directory should be
    store = str(tmp_path / "unmounted" / "store")
    done = _cairn_run(store, "dag/task/run/0", marker, tmp_path, {})
    assert done.returncode == ExitCode.STORAGE, done.stderr
    assert f"cannot create the store directory {store}" in done.stderr
    assert not marker.exists()
