"""A suspend request from the store (``cairn suspend``) in the pod setting: ``cairn run`` in the
main container polls the store itself (cairn.runtime.suspend), so the sidecar needs to do
nothing but upload the final dump it spools, as for any snapshot. Two real processes sharing a
directory, as the transformed pod's containers do; real CRIU; the requests through the real CLI.
The sidecar runs as in a Job pod (``--owner-job``, against a FAKE Kubernetes API server): a
suspend request is honoured without asking it (no SIGTERM): its Job is read once, before the
main container starts (the committed seqs its annotation keeps), and only patched after, with
the seq of the final snapshot the sidecar committed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cairn.k8s.committed import ANNOTATION, STARTED_PATH, parse_entries
from cairn.process.spool import Spool
from cairn.runtime import channel
from cairn.store import Key
from cairn import open_store
from tests.integration.k8s.fakes import FakeKubernetesAPI, serve
from tests.integration.k8s.test_sidecar import SidecarProcess
from tests.support.cairn_run import COUNTER, CairnRun, can_run_criu, metric_steps, wait_for
from tests.support.hang import HANG_S

pytestmark = pytest.mark.isolated  # CRIU restores at fixed PIDs (make test: in a PID namespace of its own)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cairn.cli.main", *args], capture_output=True,
                          text=True, timeout=HANG_S)


@pytest.mark.slow
@pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)")
def test_a_suspend_request_is_honoured_by_the_main_container_in_a_pod(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared, store, logs = tmp_path / "shared", tmp_path / "store", tmp_path / "logs"
    shared.mkdir()
    # The transform's CAIRN_COMMITTED_DIR, for the sidecar and the main container alike.
    monkeypatch.setenv("CAIRN_COMMITTED_DIR", str(shared / "committed"))
    metrics_file = tmp_path / "metrics.txt"
    key, steps = "ml/train/0", 200
    api = FakeKubernetesAPI()
    api.jobs[("ml", "train")] = False
    token = tmp_path / "token"
    token.write_text(api.token)
    extra = ["--notice-file", str(shared / channel.NOTICE_NAME),
             "--status-file", str(shared / channel.STATUS_NAME),
             "--spool", str(shared / "spool"), "--suspend-poll", "0.5s"]
    command = [sys.executable, str(COUNTER), str(metrics_file), str(steps), "0.05"]
    with serve(api):
        sidecar = SidecarProcess(shared, logs, "--no-metadata", "--upload", "--store", str(store),
                                 "--key", key, "--owner-job", "ml/train", "--kube-api", api.url,
                                 "--kube-token-file", str(token))
        try:
            wait_for(lambda: Spool(str(shared / "spool")).uploader_alive(), 30, "the uploader")
            wait_for(lambda: sidecar.get(STARTED_PATH)[0] == 200, 30, "the startup probe")
            first = CairnRun(store=str(store), key=key, command=command, workdir=shared / "run",
                             logs=logs, every="0", grace="30s", extra=extra)
            wait_for(lambda: metrics_file.exists() and len(metric_steps(metrics_file)) >= 5
                     or first.proc.poll() is not None, 60, "the workload to step")
            asked = _cli("suspend", str(store), key, "--reason", "GPUs for an urgent job")
            assert asked.returncode == 0, asked.stderr
            assert first.wait(120) == 77, first.stderr
            assert "suspended on request" in first.stderr and "GPUs for an urgent job" in \
                first.stderr
            with open_store(str(store), create=False) as s:
                outcome = s.records.outcomes(Key.parse(key))[-1]
                seq = s.snapshots(Key.parse(key))[0].seq
            assert outcome.outcome.value == "suspended"
            assert outcome.detail["suspend"]["reason"] == "GPUs for an urgent job"
            assert "cause" not in outcome.detail  # no SIGTERM: the sidecar was not asked
            # Its Job read once, before the main container started, and never asked after.
            assert [r.method for r in api.requests if r.method != "PATCH"] == ["GET"]
            assert sidecar.metrics()[("cairn_sidecar_last_upload_seq", ())] == seq
            with open_store(str(store), create=False) as s:
                store_url = s.url
            wait_for(lambda: parse_entries(api.annotations.get(("ml", "train"), {}).get(
                ANNOTATION), where="") == {(store_url, key): seq}, 30, "the Job's annotation")
            done = len(metric_steps(metrics_file))
            assert 0 < done < steps

            # Held: a new pod (the Job's retry) stops before it starts until a resume.
            held = CairnRun(store=str(store), key=key, command=command, workdir=shared / "run",
                            logs=logs, every="0", grace="30s", extra=extra)
            assert held.wait(120) == 77, held.stderr
            assert len(metric_steps(metrics_file)) == done
            resumed = _cli("resume", str(store), key)
            assert resumed.returncode == 0, resumed.stderr
            second = CairnRun(store=str(store), key=key, command=command, workdir=shared / "run",
                              logs=logs, every="0", grace="30s", extra=extra)
            assert second.wait(120) == 0, second.stderr
            assert f"restored snapshot seq {seq}" in second.stderr
            assert metric_steps(metrics_file) == list(range(steps))
        finally:
            assert sidecar.stop() == 0, sidecar.stderr
