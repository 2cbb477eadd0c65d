"""The sidecar uploads (ADR 0014): ``cairn run --spool`` and ``cairn sidecar --upload`` as two
real processes sharing a directory, as the two containers of a transformed pod do. Real CRIU
dumps; notices from a FAKE GCE metadata server (none can run here). The snapshots reach the
store only through the sidecar: every ``snap`` record and manifest names the sidecar's process
as its writer, never the supervisor's."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cairn.runtime import channel
from cairn.process import spool as spool_mod
from cairn.process.spool import Spool
from cairn.store import Key
from cairn import open_store
from cairn.store.slotlog import RecordKind
from tests.integration.k8s.fakes import FakeMetadataServer, serve
from tests.integration.k8s.test_sidecar import SidecarProcess
from tests.support.cairn_run import COUNTER, CairnRun, can_run_criu, metric_steps, wait_for
from tests.support.fake_dump import fake_dump
from tests.support.hang import HANG_S

needs_criu = pytest.mark.skipif(not can_run_criu(),
                                reason="needs root and a criu binary (make criu)")


@pytest.fixture()
def fake_metadata() -> Iterator[FakeMetadataServer]:
    fake = FakeMetadataServer()
    with serve(fake):
        yield fake


def _writers(store_path: Path, key: str) -> list[tuple[int, int, int]]:
    """(seq, record writer pid, manifest producer pid) of every snap record in the log."""
    with open_store(str(store_path), create=False) as store:
        return [(r.seq, r.body["writer"]["pid"], r.manifest.metadata["producer"]["pid"])
                for r in store.history(Key.parse(key)) if r.kind is RecordKind.SNAP]


def _no_spool_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CAIRN_SPOOL_DIR"}


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@pytest.mark.slow
@needs_criu
def test_the_sidecar_uploads_periodic_and_final_snapshots_and_the_retry_resumes(
        tmp_path: Path, fake_metadata: FakeMetadataServer) -> None:
    shared, store, logs = tmp_path / "shared", tmp_path / "store", tmp_path / "logs"
    shared.mkdir()
    metrics_file = tmp_path / "work" / "metrics.txt"
    metrics_file.parent.mkdir()
    steps, key = 200, "dag/train/spooled"
    spool_dir = shared / "spool"
    sidecar = SidecarProcess(shared, logs, "--metadata-url", fake_metadata.url,
                             "--preemption-window", "15s", "--upload", "--store", str(store),
                             "--key", key)
    extra = ["--notice-file", str(shared / channel.NOTICE_NAME),
             "--status-file", str(shared / channel.STATUS_NAME), "--spool", str(spool_dir)]
    command = [sys.executable, str(COUNTER), str(metrics_file), str(steps), "0.05"]
    try:
        wait_for(lambda: Spool(str(spool_dir)).uploader_alive(), 30, "the uploader's heartbeat")
        first = CairnRun(store=str(store), key=key, command=command, workdir=shared / "run",
                         logs=logs, every="1s", grace="30s", extra=extra)
        # Periodic snapshots: spooled by the supervisor, committed by the sidecar, which the
        # supervisor learns from the result files.
        wait_for(lambda: len(first.committed()) >= 2 or first.proc.poll() is not None, 120,
                 "two periodic snapshots committed by the sidecar")
        assert first.proc.poll() is None, first.stderr
        assert "snapshot spooled as entry" in first.stderr
        assert re.search(r"snapshot seq \d+ committed by the sidecar \(entry ", first.stderr)
        assert not re.search(r"snapshot seq \d+ committed: frozen", first.stderr), \
            "the supervisor ingested a snapshot itself"

        fake_metadata.set("preempted", "TRUE")
        assert first.wait(120) == 75, first.stderr
        final = first.committed()[-1]
        assert re.search(rf"final snapshot seq {final} committed \(uploaded by the sidecar\)",
                         first.stderr), first.stderr

        writers = _writers(store, key)
        assert writers and writers[-1][0] == final
        for seq, record_pid, producer_pid in writers:
            assert record_pid == producer_pid == sidecar.proc.pid, (
                f"seq {seq} was written by pid {record_pid}, not the sidecar "
                f"({sidecar.proc.pid}); the supervisor was {first.proc.pid}")
        with open_store(str(store), create=False) as s:
            assert s.snapshots(Key.parse(key))[0].seq == final
            assert s.verify(Key.parse(key)).ok
        assert Spool(str(spool_dir)).entries() == []  # nothing left behind

        served = sidecar.metrics()
        status = channel.read_status(str(shared / channel.STATUS_NAME))
        assert status is not None and status.last_seq == final
        assert served[("cairn_last_snapshot_seq", ())] == final
        assert served[("cairn_snapshots_total", ())] == status.snapshots >= 2
        assert served[("cairn_snapshots_spooled_total", ())] == status.spooled >= status.snapshots
        assert served[("cairn_sidecar_uploads_total", ())] == status.snapshots
        assert served[("cairn_sidecar_last_upload_seq", ())] == final
        assert served[("cairn_sidecar_upload_bytes_written_total", ())] == status.bytes_written > 0
        assert served[("cairn_sidecar_spool_pending", ())] == 0
        done_before = len(metric_steps(metrics_file))
        assert 0 < done_before < steps

        # The retry, writing the store itself (no spool): it restores what the sidecar
        # uploaded and the workload goes on without repeating a step.
        second = CairnRun(store=str(store), key=key, command=command, workdir=shared / "run",
                          logs=logs, every="0", grace="30s", env=_no_spool_env())
        assert second.wait(120) == 0, second.stderr
        assert f"restored snapshot seq {final}" in second.stderr
        assert metric_steps(metrics_file) == list(range(steps))
    finally:
        assert sidecar.stop() == 0, sidecar.stderr


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@pytest.mark.slow
@needs_criu
def test_on_success_pending_entries_are_cancelled_and_done_ends_the_log(tmp_path: Path) -> None:
    """No snap record may follow the step's done. First with no uploader at all: the entry
    the periodic dump spooled waits (and so does the next dump), then the step succeeds and the
    entry is cancelled, never committed. Then with the sidecar uploading as the step ends:
    whatever the timing, the log ends with the done."""
    shared, store, logs = tmp_path / "shared", tmp_path / "store", tmp_path / "logs"
    shared.mkdir()
    spool_dir = shared / "spool"
    status_file = shared / channel.STATUS_NAME
    extra = ["--spool", str(spool_dir), "--status-file", str(status_file)]

    def counter(name: str) -> list[str]:
        return [sys.executable, str(COUNTER), str(tmp_path / name), "60", "0.05"]

    alone = CairnRun(store=str(store), key="dag/train/alone", workdir=shared / "run", logs=logs,
                     command=counter("a.txt"), every="1s", grace="30s", extra=extra)
    assert alone.wait(120) == 0, alone.stderr
    assert alone.stderr.count("snapshot spooled as entry") == 1, alone.stderr
    assert "is not uploaded yet and no uploader is running" in alone.stderr
    assert "cancelled 1 spooled snapshot(s) not uploaded yet: the step is done" in alone.stderr
    status = channel.read_status(str(status_file))
    assert status is not None and status.spooled == 1 and status.snapshots == 0
    assert "no uploader is running" in (status.last_error or "")
    with open_store(str(store), create=False) as s:
        assert [r.kind for r in s.history(Key.parse("dag/train/alone"))] == [
            RecordKind.OPEN, RecordKind.DONE]
    assert Spool(str(spool_dir)).entries() == []

    sidecar = SidecarProcess(shared, logs, "--no-metadata", "--upload", "--store", str(store))
    try:
        key = "dag/train/finishes"
        run = CairnRun(store=str(store), key=key, workdir=shared / "run", logs=logs,
                       command=counter("b.txt"), every="1s", grace="30s", extra=extra)
        assert run.wait(120) == 0, run.stderr
        assert "snapshot spooled as entry" in run.stderr
        assert "marked done" in run.stderr
        with open_store(str(store), create=False) as s:
            history = s.history(Key.parse(key))
            assert history[-1].kind is RecordKind.DONE, [(r.seq, r.kind) for r in history]
            assert s.snapshots(Key.parse(key)) == []
        wait_for(lambda: Spool(str(spool_dir)).entries() == [], 30, "the spool to empty")
    finally:
        assert sidecar.stop() == 0, sidecar.stderr


def _spool_fake_entry(spool: Spool, store_url: str, key: str, epoch: int) -> str:
    entry = spool.new_entry(epoch)
    fake_dump(spool.images_dir(entry))
    spool.hand_off(entry, key=Key.parse(key), store=store_url, epoch=epoch, last_seq=epoch,
                   parent_seq=None, compat={}, info={}, tracked_paths=[])
    return entry


@pytest.mark.slow
def test_after_sigterm_the_sidecar_keeps_uploading_until_the_spool_is_empty(
        tmp_path: Path) -> None:
    """The store is unreachable when SIGTERM arrives (the entry is being retried); it comes
    back within the window, and the sidecar commits the entry before it exits."""
    shared, logs = tmp_path / "shared", tmp_path / "logs"
    shared.mkdir()
    store_path, key = tmp_path / "store", "dag/train/drain"
    with open_store(str(store_path)) as store:
        epoch = store.open_attempt(Key.parse(key)).epoch
    hidden = tmp_path / "store-away"
    store_path.rename(hidden)
    spool = Spool(str(shared / "spool"))
    entry = _spool_fake_entry(spool, f"file://{store_path}", key, epoch)
    sidecar = SidecarProcess(shared, logs, "--no-metadata", "--upload", "--sigterm-window", "60s")
    wait_for(lambda: "failed (try 1" in sidecar.stderr, 30, "a failed upload")
    sidecar.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert sidecar.proc.poll() is None, sidecar.stderr  # still draining
    hidden.rename(store_path)
    assert sidecar.proc.wait(timeout=HANG_S) == 0, sidecar.stderr
    assert "spooled snapshot(s) left to upload" in sidecar.stderr
    assert re.search(rf"entry {entry} committed as seq {epoch + 1}", sidecar.stderr)
    with open_store(str(store_path), create=False) as store:
        assert [i.seq for i in store.snapshots(Key.parse(key))] == [epoch + 1]
    assert spool.pending() == []
    assert spool_mod.Result.from_json(json.loads(
        Path(spool.path, entry + spool_mod.RESULT_SUFFIX).read_text())).seq == epoch + 1


@pytest.mark.slow
def test_the_drain_ends_when_the_window_runs_out(tmp_path: Path) -> None:
    shared, logs = tmp_path / "shared", tmp_path / "logs"
    shared.mkdir()
    spool = Spool(str(shared / "spool"))
    _spool_fake_entry(spool, f"file://{tmp_path}/never", "dag/train/lost", 1)
    sidecar = SidecarProcess(shared, logs, "--no-metadata", "--upload", "--sigterm-window", "3s")
    wait_for(lambda: "failed (try 1" in sidecar.stderr, 30, "a failed upload")
    started = time.monotonic()
    sidecar.proc.send_signal(signal.SIGTERM)
    assert sidecar.proc.wait(timeout=30) == 0, sidecar.stderr
    assert time.monotonic() - started < 15
    assert "stopping with 1 spooled snapshot(s) not uploaded" in sidecar.stderr
    assert len(spool.pending()) == 1  # kept: nothing is deleted that was not committed
