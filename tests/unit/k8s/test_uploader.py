"""The sidecar's uploader (``cairn sidecar --upload``) one pass at a time, against a real
local store: order, supersession, cancellation, fencing, retries with backoff, and what the
metrics page shows of it. CRIU's images are stood in for by byte-built ones."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cairn.k8s import metrics
from cairn.k8s.uploader import MAX_BACKOFF_S, Uploader, UploadSettings
from cairn.process import spool as spool_mod
from cairn.process.spool import Spool, UploadOutcome
from cairn.store import Attempt, Key, Store
from cairn import open_store
from tests.support.fake_dump import fake_dump

KEY = Key.parse("dag/train/run-1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _spool_one(spool: Spool, store_url: str, attempt: object, tmp_path: Path,
               *, complete: bool = True) -> str:
    log_file = tmp_path / "out.log"
    log_file.write_bytes(b"step\n")
    entry = spool.new_entry(attempt.epoch)  # type: ignore[attr-defined]
    fake_dump(spool.images_dir(entry), appended={str(log_file): 5})
    if complete:
        spool.hand_off(entry, key=KEY, store=store_url, epoch=attempt.epoch,  # type: ignore[attr-defined]
                       last_seq=attempt.log.last_seq, parent_seq=None, compat={},  # type: ignore[attr-defined]
                       info={}, tracked_paths=[str(log_file)])
    return entry


@contextmanager
def _uploading(tmp_path: Path, **settings: Any) -> Iterator[tuple[Store, Attempt, Uploader]]:
    """A local store with an open attempt of KEY, and an uploader of ``tmp_path/spool`` (with
    ``settings``) that stops after the block: ``(store, attempt, uploader)``."""
    with open_store(str(tmp_path / "store")) as store:
        attempt = store.open_attempt(KEY)
        uploader = Uploader(UploadSettings(spool_dir=str(tmp_path / "spool"), **settings))
        yield store, attempt, uploader
        uploader.stop()


def _result(spool: Spool, entry: str) -> dict:
    return json.loads(Path(spool.path, entry + spool_mod.RESULT_SUFFIX).read_text())


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_only_complete_entries_are_taken_and_each_leaves_a_result(tmp_path: Path) -> None:
    with _uploading(tmp_path) as (store, attempt, uploader):
        spool = uploader.spool
        half = _spool_one(spool, store.url, attempt, tmp_path, complete=False)
        assert uploader.step() is False  # a dump without its ticket: never taken
        assert store.snapshots(KEY) == [] and spool.entries() == [half]
        spool.hand_off(half, key=KEY, store=store.url, epoch=attempt.epoch,
                       last_seq=attempt.log.last_seq, parent_seq=None, compat={}, info={},
                       tracked_paths=[])
        assert uploader.step() is True
        (info,) = store.snapshots(KEY)
        assert _result(spool, half) == {**_result(spool, half), "outcome": "committed",
                                        "seq": info.seq, "epoch": attempt.epoch}
        assert spool.entries() == []  # deleted once the result is written
        stats = uploader.stats
        assert (stats.committed, stats.last_seq, stats.pending) == (1, info.seq, 1)
        assert uploader.step() is False and uploader.stats.pending == 0


def test_each_commit_is_recorded_before_the_supervisor_can_hear_of_it(tmp_path: Path) -> None:
    """ADR 0049: the sidecar records the committed seq (``on_commit``) before it writes the
    verdict, so the supervisor's own record finds it there; a drop records nothing."""
    from cairn.k8s.committed import SharedMarks
    from cairn.runtime.rollback import local_mark

    marks = SharedMarks(str(tmp_path / "committed"))
    seen: list[tuple[str, str, int, bool]] = []

    def on_commit(store_url: str, key: str, seq: int) -> None:
        entries = [e for e in uploader.spool.entries() if not e.endswith(spool_mod.RESULT_SUFFIX)]
        verdict = Path(uploader.spool.path, entries[0] + spool_mod.RESULT_SUFFIX)
        seen.append((store_url, key, seq, verdict.exists()))
        marks.record_commit(store_url, key, seq)

    with open_store(str(tmp_path / "store")) as store:
        attempt = store.open_attempt(KEY)
        uploader = Uploader(UploadSettings(spool_dir=str(tmp_path / "spool")),
                            on_commit=on_commit)
        try:
            older = _spool_one(uploader.spool, store.url, attempt, tmp_path)
            _spool_one(uploader.spool, store.url, attempt, tmp_path)
            assert uploader.step() and uploader.step()
            assert _result(uploader.spool, older)["outcome"] == "superseded"
            (info,) = store.snapshots(KEY)
            assert seen == [(store.url, str(KEY), info.seq, False)]
            assert local_mark(store.url, str(KEY), marks.environ).read() == info.seq
        finally:
            uploader.stop()


def test_an_older_entry_of_the_same_attempt_is_superseded(tmp_path: Path) -> None:
    with _uploading(tmp_path) as (store, attempt, uploader):
        older = _spool_one(uploader.spool, store.url, attempt, tmp_path)
        newer = _spool_one(uploader.spool, store.url, attempt, tmp_path)
        assert uploader.step() and uploader.step()
        assert _result(uploader.spool, older)["outcome"] == "superseded"
        assert _result(uploader.spool, newer)["outcome"] == "committed"
        (info,) = store.snapshots(KEY)
        assert info.manifest.metadata["user"]["process"]["spool_entry"] == newer
        assert uploader.stats.dropped == {"superseded": 1}
        assert uploader.stats.last_error is None  # superseding is no error


def test_a_cancelled_entry_is_removed_unsent(tmp_path: Path) -> None:
    with _uploading(tmp_path) as (store, attempt, uploader):
        entry = _spool_one(uploader.spool, store.url, attempt, tmp_path)
        assert uploader.spool.cancel(entry)
        assert uploader.step() is False
        assert uploader.spool.entries() == [] and store.snapshots(KEY) == []


def test_a_fenced_entry_is_dropped_and_counted_as_an_error(tmp_path: Path) -> None:
    with _uploading(tmp_path) as (store, old, uploader):
        entry = _spool_one(uploader.spool, store.url, old, tmp_path)
        store.open_attempt(KEY)
        assert uploader.step() is True
        assert _result(uploader.spool, entry)["outcome"] == "fenced"
        assert uploader.spool.entries() == [] and store.snapshots(KEY) == []
        stats = uploader.stats
        assert stats.dropped == {"fenced": 1} and entry in (stats.last_error or "")
        page = _samples(metrics.render(None, notices_sent={}, watchers_healthy={},
                                       uploads=stats))
        assert page[("cairn_sidecar_uploads_dropped_total", (("reason", "fenced"),))] == 1
        assert page[("cairn_sidecar_uploads_total", ())] == 0
        assert page[("cairn_sidecar_last_upload_error_info", (("error", stats.last_error),))] == 1


def test_failures_are_retried_with_backoff_and_block_younger_entries(tmp_path: Path) -> None:
    with open_store(str(tmp_path / "store")) as store:
        first = store.open_attempt(KEY)
        clock = Clock()
        uploader = Uploader(UploadSettings(spool_dir=str(tmp_path / "spool")), clock=clock)
        spool = uploader.spool
        # The older entry names a store that is not there (yet): its upload fails.
        broken_url = f"file://{tmp_path}/not-yet"
        stuck = _spool_one(spool, broken_url, first, tmp_path)
        second = store.open_attempt(KEY)
        younger = _spool_one(spool, store.url, second, tmp_path)
        assert uploader.step() is False
        stats = uploader.stats
        assert stats.failures == 1 and stuck in (stats.last_error or "")
        assert spool.pending() == [stuck, younger]  # kept, and nothing younger went first
        assert uploader.step() is False and uploader.stats.failures == 1  # backing off
        clock.now += 1.0
        assert uploader.step() is False and uploader.stats.failures == 2
        clock.now += 1.5
        assert uploader.step() is False and uploader.stats.failures == 2  # 2 s this time
        clock.now += 1.0
        assert uploader.step() is False and uploader.stats.failures == 3
        assert store.snapshots(KEY) == []
        page = _samples(metrics.render(None, notices_sent={}, watchers_healthy={},
                                       uploads=uploader.stats))
        assert page[("cairn_sidecar_upload_failures_total", ())] == 3
        assert page[("cairn_sidecar_spool_pending", ())] == 2

        # The store appears (the network came back): the old entry is tried at last, and is
        # fenced by the newer attempt in that store; the younger one is committed after it.
        with open_store(broken_url[len("file://"):]) as other:
            other.open_attempt(KEY)
            other.open_attempt(KEY)
        clock.now += MAX_BACKOFF_S
        assert uploader.step() is True
        assert _result(spool, stuck)["outcome"] == "fenced"
        assert uploader.step() is True
        assert _result(spool, younger)["outcome"] == "committed"
        assert [i.epoch for i in store.snapshots(KEY)] == [second.epoch]
        uploader.stop()


def test_bad_tickets_and_foreign_keys_are_dropped(tmp_path: Path) -> None:
    with _uploading(tmp_path, key="dag/train/another-run") as (store, attempt, uploader):
        spool = uploader.spool
        garbled = _spool_one(spool, store.url, attempt, tmp_path)
        Path(spool.entry_path(garbled), spool_mod.TICKET).write_text("{not json")
        assert uploader.step() is True
        assert _result(spool, garbled)["outcome"] == "invalid"
        foreign = _spool_one(spool, store.url, attempt, tmp_path)
        assert uploader.step() is True
        assert "not this sidecar's --key" in _result(spool, foreign)["detail"]
        assert uploader.stats.dropped == {"invalid": 2} and store.snapshots(KEY) == []


def test_the_thread_uploads_beats_and_drains(tmp_path: Path) -> None:
    with open_store(str(tmp_path / "store")) as store:
        attempt = store.open_attempt(KEY)
        uploader = Uploader(UploadSettings(spool_dir=str(tmp_path / "spool"), poll_s=0.05))
        uploader.start()
        try:
            assert uploader.spool.uploader_alive()
            assert uploader.spool.heartbeat()["pid"] == os.getpid()
            entry = _spool_one(uploader.spool, store.url, attempt, tmp_path)
            assert uploader.drain(30) == 0
            deadline = time.monotonic() + 30
            while not Path(uploader.spool.path, entry + spool_mod.RESULT_SUFFIX).exists():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert _result(uploader.spool, entry)["outcome"] == UploadOutcome.COMMITTED.value
        finally:
            uploader.stop()
        assert len(store.snapshots(KEY)) == 1
        assert uploader.drain(0) == 0


@pytest.mark.parametrize("upload", [False, True])
def test_the_metrics_page_has_upload_families_only_when_uploading(upload: bool,
                                                                   tmp_path: Path) -> None:
    from cairn.k8s.sidecar import Sidecar, SidecarSettings

    settings = SidecarSettings(shared_dir=str(tmp_path), metadata=None, upload=UploadSettings(
        spool_dir=str(tmp_path / "spool")) if upload else None)
    page = _samples(Sidecar(settings).metrics_page())
    assert (("cairn_sidecar_uploads_total", ()) in page) is upload
    assert (("cairn_sidecar_last_upload_seq", ()) in page) is upload
