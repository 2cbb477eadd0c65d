"""``cairn sidecar`` as a real process: notices from a FAKE GCE metadata server and a FAKE
Kubernetes API server (neither can run here) reach the shared directory; /readyz and /metrics
are scraped over HTTP; and, end to end with real CRIU, ``cairn run`` in a second process takes
the notice, commits a final snapshot, exits 75 and resumes from it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cairn.runtime import channel
from cairn.k8s.watchers import MAINTENANCE_LABEL
from cairn.store import Key
from cairn import open_store
from tests.integration.k8s.fakes import FakeKubernetesAPI, FakeMetadataServer, serve
from tests.support.cairn_run import COUNTER, CairnRun, can_run_criu, metric_steps, wait_for
from tests.support.hang import HANG_S


class SidecarProcess:
    def __init__(self, shared: Path, logs: Path, *args: str) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.err_path = logs / "sidecar.err"
        argv = [sys.executable, "-m", "cairn.cli.main", "sidecar", "--shared", str(shared),
                "--host", "127.0.0.1", "--port", "0", *args]
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         start_new_session=True)
        wait_for(lambda: self.port is not None or self.proc.poll() is not None, 30,
                 "the sidecar to listen")
        assert self.proc.poll() is None, self.stderr

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def port(self) -> int | None:
        m = re.search(r"metrics on port (\d+)", self.stderr)
        return int(m.group(1)) if m else None

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        code, text = self.get("/metrics")
        assert code == 200, text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the sidecar ignored SIGTERM\n{self.stderr}") from None


@pytest.fixture()
def fake_metadata() -> Iterator[FakeMetadataServer]:
    fake = FakeMetadataServer()
    with serve(fake):
        yield fake


def test_sidecar_hands_notices_over_and_serves_metrics(tmp_path: Path,
                                                       fake_metadata: FakeMetadataServer) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    api = FakeKubernetesAPI()
    api.nodes["node-a"] = {}
    token = tmp_path / "token"
    token.write_text(api.token)
    with serve(api):
        sidecar = SidecarProcess(
            shared, tmp_path / "logs", "--metadata-url", fake_metadata.url,
            "--preemption-window", "15s", "--watch-node-label", "--node-name", "node-a",
            "--kube-api", api.url, "--kube-token-file", str(token), "--label-interval", "0.2s",
            "--maintenance-lead", "10m")
        try:
            assert sidecar.get("/readyz") == (200, "ok\n")
            assert sidecar.get("/nothing")[0] == 404
            wait_for(lambda: fake_metadata.waiting("preempted") >= 1 and len(api.requests) >= 2,
                     30, "the watchers to poll")
            before = sidecar.metrics()
            assert before[("cairn_supervisor_reporting", ())] == 0
            assert before[("cairn_sidecar_watcher_healthy", (("watcher", "node node-a label"),))] == 1
            assert not (shared / channel.NOTICE_NAME).exists()

            # Maintenance in five minutes, within the 10 minute lead: a notice for that time.
            when = int(time.time()) + 300
            api.label("node-a", MAINTENANCE_LABEL, str(when))
            wait_for(lambda: (shared / channel.NOTICE_NAME).exists(), 30, "a notice file")
            notice = channel.read_notice(str(shared / channel.NOTICE_NAME))
            assert notice is not None and (notice.source, notice.deadline) == ("node-label", when)

            # Preemption: an earlier deadline replaces the pending notice.
            fake_metadata.set("preempted", "TRUE")
            wait_for(lambda: channel.read_notice(str(shared / channel.NOTICE_NAME)).source
                     == "gce-preempted", 30, "the preemption notice")
            notice = channel.read_notice(str(shared / channel.NOTICE_NAME))
            assert notice is not None and notice.deadline - notice.issued_at == pytest.approx(15)

            # What the supervisor reports is served.
            channel.write_status(str(shared / channel.STATUS_NAME), channel.RunStatus(
                pid=1, started_at=time.time(), snapshots=4, bytes_written=2048, last_seq=7,
                last_success_at=time.time(), updated_at=time.time()))
            after = sidecar.metrics()
            assert after[("cairn_supervisor_reporting", ())] == 1
            assert after[("cairn_snapshots_total", ())] == 4
            assert after[("cairn_last_snapshot_seq", ())] == 7
            assert after[("cairn_sidecar_notices_total", (("source", "gce-preempted"),))] == 1
            assert after[("cairn_sidecar_notices_total", (("source", "node-label"),))] == 1
        finally:
            code = sidecar.stop()
    assert code == 0, sidecar.stderr
    # A pending notice with an earlier deadline is not replaced by the SIGTERM one.
    notice = channel.read_notice(str(shared / channel.NOTICE_NAME))
    assert notice is not None and notice.source == "gce-preempted"


def test_sidecar_refuses_a_missing_shared_directory(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "cairn.cli.main", "sidecar", "--shared",
                             str(tmp_path / "absent"), "--no-metadata"],
                            capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 2
    assert "is not a directory: mount the pod's shared volume" in result.stderr


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@pytest.mark.slow
@pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)")
def test_preemption_notice_ends_in_a_committed_final_snapshot_and_a_resume(
        tmp_path: Path, fake_metadata: FakeMetadataServer) -> None:
    """Two processes sharing a directory, as the two containers of the transformed pod do."""
    shared, store, logs = tmp_path / "shared", tmp_path / "store", tmp_path / "logs"
    shared.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    metrics_file = work / "metrics.txt"
    steps, key = 160, "dag/train/run-1"
    sidecar = SidecarProcess(shared, logs, "--metadata-url", fake_metadata.url,
                             "--preemption-window", "15s")
    extra = ["--notice-file", str(shared / channel.NOTICE_NAME),
             "--status-file", str(shared / channel.STATUS_NAME)]
    command = [sys.executable, str(COUNTER), str(metrics_file), str(steps), "0.05"]
    try:
        first = CairnRun(store=str(store), key=key, command=command, workdir=shared / "run",
                         logs=logs, every="1s", grace="30s", extra=extra)
        wait_for(lambda: first.committed() or first.proc.poll() is not None, 120,
                 "a periodic snapshot")
        assert first.proc.poll() is None, first.stderr
        fake_metadata.set("preempted", "TRUE")
        assert first.wait(120) == 75, first.stderr
        assert "notice from gce-preempted" in first.stderr
        final = first.committed()[-1]
        assert re.search(rf"final snapshot seq {final} committed", first.stderr), first.stderr
        assert not (shared / channel.NOTICE_NAME).exists()  # taken by the supervisor
        with open_store(str(store), create=False) as s:
            assert s.snapshots(Key.parse(key))[0].seq == final
            assert s.verify(Key.parse(key)).ok
        served = sidecar.metrics()
        assert served[("cairn_last_snapshot_seq", ())] == final
        assert served[("cairn_snapshots_total", ())] == len(set(first.committed()))
        assert served[("cairn_supervisor_notices_total", (("source", "gce-preempted"),))] == 1
        assert served[("cairn_snapshot_bytes_written_total", ())] > 0
        done_before = len(metric_steps(metrics_file))
        assert 0 < done_before < steps

        # The retry (the main container restarted in the same pod: the notice was taken).
        second = CairnRun(store=str(store), key=key, command=command, workdir=shared / "run",
                          logs=logs, every="0", grace="30s", extra=extra)
        assert second.wait(120) == 0, second.stderr
        assert f"restored snapshot seq {final}" in second.stderr
        assert metric_steps(metrics_file) == list(range(steps))  # no step lost or redone
        served = sidecar.metrics()
        assert served[("cairn_resumes_total", ())] == 1
        assert served[("cairn_work_saved_seconds_total", ())] > 0
    finally:
        assert sidecar.stop() == 0, sidecar.stderr
    os.listdir(shared)  # the shared directory outlives both, as an emptyDir does


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@pytest.mark.slow
@pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)")
def test_a_notice_past_its_deadline_keeps_the_previous_snapshot(tmp_path: Path) -> None:
    """The budget is the notice's deadline too: none left, no final dump, exit 76."""
    shared = tmp_path / "shared"
    shared.mkdir()
    metrics_file = tmp_path / "metrics.txt"
    run = CairnRun(store=str(tmp_path / "store"), key="dag/train/late", workdir=shared / "run",
                   command=[sys.executable, str(COUNTER), str(metrics_file), "1000", "0.05"],
                   logs=tmp_path / "logs", every="0", grace="30s",
                   extra=["--notice-file", str(shared / channel.NOTICE_NAME),
                          "--status-file", str(shared / channel.STATUS_NAME)])
    wait_for(lambda: metrics_file.exists() or run.proc.poll() is not None, 60, "the workload")
    now = time.time()
    channel.write_notice(str(shared / channel.NOTICE_NAME), channel.Notice(
        source="node-label", reason="maintenance now", issued_at=now - 60, deadline=now - 1))
    assert run.wait(60) == 76, run.stderr
    assert "notice from node-label (maintenance now): no final snapshot" in run.stderr
    assert run.snapshots() == []
    status = channel.read_status(str(shared / channel.STATUS_NAME))
    assert status is not None and status.notices == {"node-label": 1} and status.snapshots == 0
