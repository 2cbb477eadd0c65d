"""The spool between ``cairn run --spool`` and the sidecar's uploader: the ticket format, entry
order, what is visible when, cancellation, and :func:`cairn.process.spool.upload` against a
real local store (CRIU's images are stood in for by byte-built ones: see
tests/support/fake_dump.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cairn.exceptions import ConfigError, Fenced
from cairn.process import snapshot as snap_mod
from cairn.process import spool as spool_mod
from cairn.process.snapshot import TrackedFile
from cairn.process.spool import Result, Spool, Ticket, UploadOutcome
from cairn.process.spool_client import SpoolClient
from cairn.process.supervisor import RunSettings, Supervisor
from cairn.store import Attempt, Key, Store
from cairn import open_store
from cairn.store.slotlog import RecordKind
from tests.support.fake_dump import fake_dump

KEY = Key.parse("dag/train/run-1")


def _ticket(**changes: object) -> Ticket:
    fields: dict[str, object] = dict(
        entry=spool_mod.entry_name(7, 1, now=1700000000.0), key=KEY.components,
        store="file:///data/cairn", epoch=7, last_seq=9, parent_seq=5,
        compat={"image": "sha256:abc"}, info={"root_pid": 4000, "runtime_s": 12.5},
        tracked=(TrackedFile("/var/run/cairn/run/x/stdout.log", 120),), created_at=1700000000.5)
    fields.update(changes)
    return Ticket(**fields)  # type: ignore[arg-type]


def _spooled(spool: Spool, store_url: str, attempt: object, log_file: Path,
             text: bytes = b"step 1\nstep 2\n") -> Ticket:
    """Do what the supervisor does: an entry, a dump in it, the hand-off."""
    log_file.write_bytes(text + b"written after the dump\n")
    entry = spool.new_entry(attempt.epoch)  # type: ignore[attr-defined]
    fake_dump(spool.images_dir(entry), appended={str(log_file): len(text)})
    return spool.hand_off(entry, key=KEY, store=store_url, epoch=attempt.epoch,  # type: ignore[attr-defined]
                          last_seq=attempt.log.last_seq, parent_seq=None,  # type: ignore[attr-defined]
                          compat={"image": "test"}, info={"runtime_s": 1.0},
                          tracked_paths=[str(log_file)])


def _dumped_entry(spool: Spool, log_file: Path, data: bytes, dumped: int) -> str:
    """A new entry of epoch 3 whose dump has ``log_file`` (written with ``data`` now) open at
    size ``dumped``."""
    log_file.write_bytes(data)
    entry = spool.new_entry(3)
    fake_dump(spool.images_dir(entry), appended={str(log_file): dumped})
    return entry


def _hand_off(spool: Spool, entry: str, *tracked_paths: str) -> Ticket:
    """Hand ``entry`` off for epoch 3 of KEY, after seq 3, tracking ``tracked_paths``."""
    return spool.hand_off(entry, key=KEY, store="file:///s", epoch=3, last_seq=3,
                          parent_seq=None, compat={}, info={}, tracked_paths=list(tracked_paths))


def _supervisor(store: Store, tmp_path: Path) -> tuple[Supervisor, Spool]:
    """A supervisor of KEY (running ``true``) on ``store``, with no attempt yet, and the
    spool at ``tmp_path/spool`` it is set up with."""
    settings = RunSettings(store=store.url, key=str(KEY), argv=("true",),
                           spool_dir=str(tmp_path / "spool"))
    supervisor = Supervisor(settings)
    supervisor.ctx.store = store
    return supervisor, Spool(settings.spool_dir)  # type: ignore[arg-type]


@contextmanager
def _one_spooled(tmp_path: Path) -> Iterator[tuple[Store, Attempt, Spool, Ticket]]:
    """A local store with an open attempt of KEY, and one entry of it spooled (``out.log``
    tracked): ``(store, attempt, spool, ticket)``."""
    with open_store(str(tmp_path / "store")) as store:
        attempt = store.open_attempt(KEY)
        spool = Spool(str(tmp_path / "spool"))
        yield store, attempt, spool, _spooled(spool, store.url, attempt, tmp_path / "out.log")


# -- the format -------------------------------------------------------------------------------

def test_a_ticket_round_trips_through_json() -> None:
    ticket = _ticket()
    doc = json.loads(json.dumps(ticket.to_json()))
    assert doc["version"] == spool_mod.SPOOL_VERSION
    assert Ticket.from_json(doc) == ticket
    assert Ticket.from_json({**doc, "parent_seq": None}).parent_seq is None


@pytest.mark.parametrize("change,message", [
    ({"version": 2}, "run the same cairn version in the sidecar and the main container"),
    ({"epoch": "seven"}, "malformed spool ticket"),
    ({"tracked": [{"path": "/x"}]}, "malformed spool ticket"),
    ({"entry": "../etc"}, "inconsistent spool ticket"),
    ({"last_seq": 3}, "inconsistent spool ticket"),  # before the attempt's own open record
    ({"key": []}, "key"),
])
def test_a_bad_ticket_is_refused(change: dict[str, object], message: str) -> None:
    doc = {**_ticket().to_json(), **change}
    with pytest.raises(ConfigError, match=message):
        Ticket.from_json(doc)


def test_results_round_trip() -> None:
    result = Result("000000000007-000001-1700000000000", UploadOutcome.COMMITTED, 7, seq=12,
                    bytes_written=10, image_bytes=20, frozen_us=30, upload_s=0.5, at=5.0)
    assert Result.from_json(json.loads(json.dumps(result.to_json()))) == result
    with pytest.raises(ConfigError):
        Result.from_json({**result.to_json(), "outcome": "lost"})


def test_results_and_the_heartbeat_are_written_for_the_group_only(tmp_path: Path) -> None:
    """Like every other spool file (0640): the spool promises its files to its group, never
    to every user of the node (issue 34)."""
    spool = Spool(str(tmp_path / "spool"))
    spool.ensure()
    spool.write_result(Result("000000000007-000001-1700000000000", UploadOutcome.COMMITTED, 7))
    spool.write_heartbeat({"pid": 1})
    for name in ("000000000007-000001-1700000000000.result.json", spool_mod.HEARTBEAT):
        assert stat.S_IMODE(os.stat(os.path.join(spool.path, name)).st_mode) == 0o640, name
    assert spool.results()[0].epoch == 7 and spool.heartbeat()["pid"] == 1


def test_entry_names_sort_by_attempt_then_dump() -> None:
    names = [spool_mod.entry_name(12, 1, now=100.0), spool_mod.entry_name(9, 10, now=300.0),
             spool_mod.entry_name(9, 2, now=200.0), spool_mod.entry_name(12, 3, now=50.0)]
    ordered = sorted(names)
    assert [spool_mod.parse_entry(n) for n in ordered] == [(9, 2), (9, 10), (12, 1), (12, 3)]
    assert spool_mod.parse_entry("notice.json") is None
    assert spool_mod.parse_entry(".trash-" + names[0]) is None


def test_the_supervisors_counter_continues_after_a_restart(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "spool"))
    first = [spool.new_entry(4) for _ in range(2)]
    again = Spool(spool.path).new_entry(4)  # a second Spool object: the same directory
    other = spool.new_entry(5)
    assert [spool_mod.parse_entry(e) for e in (*first, again, other)] == [
        (4, 1), (4, 2), (4, 3), (5, 1)]
    assert spool.entries() == sorted([*first, again, other])


# -- visibility, cancel, permissions ---------------------------------------------------------

def test_an_entry_is_pending_only_once_its_ticket_exists(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with open_store(str(store_dir)) as store:
        attempt = store.open_attempt(KEY)
        spool = Spool(str(tmp_path / "spool"))
        entry = spool.new_entry(attempt.epoch)
        fake_dump(spool.images_dir(entry))
        (Path(spool.entry_path(entry)) / ".tmp-half.json").write_text('{"version": 1, "ent')
        assert spool.entries() == [entry]
        assert spool.pending() == [] and spool.read_ticket(entry) is None
        ticket = spool.hand_off(entry, key=KEY, store=store.url, epoch=attempt.epoch,
                                last_seq=attempt.log.last_seq, parent_seq=None, compat={},
                                info={}, tracked_paths=[])
        assert spool.pending() == [entry] == spool.pending(attempt.epoch)
        assert spool.pending(attempt.epoch + 1) == []
        assert spool.read_ticket(entry) == ticket


def test_the_entry_is_opened_up_to_the_sidecars_user(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "spool"))
    log_file = tmp_path / "out.log"
    entry = _dumped_entry(spool, log_file, b"abc", 3)
    os.chmod(Path(spool.images_dir(entry)) / "pages-1.img", 0o600)  # as CRIU leaves them
    _hand_off(spool, entry, str(log_file))
    # Owner and the shared group (the pod's fsGroup) only: never world-readable (issue 15).
    for root, dirs, files in os.walk(spool.entry_path(entry)):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o2770, root
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o640, name
    assert stat.S_IMODE(os.stat(spool.path).st_mode) == 0o2770


def test_tracked_files_are_copied_up_to_their_dumped_size(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "spool"))
    log_file = tmp_path / "out.log"
    entry = _dumped_entry(spool, log_file, b"0123456789 and more written after the dump", 10)
    ticket = _hand_off(spool, entry, str(log_file), str(tmp_path / "not-open"))
    assert ticket.tracked == (TrackedFile(str(log_file), 10),)
    assert (Path(spool.entry_path(entry)) / "files" / "0").read_bytes() == b"0123456789"
    # Truncated since the dump: the hand-off says so.
    second = _dumped_entry(spool, log_file, b"short", 10)
    with pytest.raises(ConfigError, match="shorter than its dumped size"):
        _hand_off(spool, second, str(log_file))


def test_cancel_renames_the_ticket_and_remove_leaves_nothing(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "spool"))
    entry = spool.new_entry(3)
    fake_dump(spool.images_dir(entry))
    assert spool.cancel(entry) is False  # not complete yet: nothing to withdraw
    spool.hand_off(entry, key=KEY, store="file:///s", epoch=3, last_seq=3, parent_seq=None,
                   compat={}, info={}, tracked_paths=[])
    assert spool.cancel(entry) is True
    assert spool.pending() == [] and spool.is_cancelled(entry) and spool.read_ticket(entry) is None
    assert (Path(spool.entry_path(entry)) / spool_mod.CANCELLED).exists()
    spool.remove(entry)
    assert os.listdir(spool.path) == []


# -- upload() against a real local store -------------------------------------------------------

def test_upload_commits_as_the_attempts_next_snapshot(tmp_path: Path) -> None:
    with _one_spooled(tmp_path) as (store, attempt, spool, ticket):
        result = spool_mod.upload(store, spool, ticket)
        assert (result.outcome, result.seq, result.epoch) == (UploadOutcome.COMMITTED,
                                                              attempt.epoch + 1, attempt.epoch)
        assert result.bytes_written > 0 and result.frozen_us == 1234
        (info,) = store.snapshots(KEY)
        assert info.seq == result.seq and info.epoch == attempt.epoch
        process = snap_mod.process_info(info.manifest)
        assert process["spool_entry"] == ticket.entry
        assert process["tracked"] == [{"path": str(tmp_path / "out.log"), "size": 14}]
        assert info.manifest.metadata["producer"]["pid"] == os.getpid()
        # fetch() puts the tracked file back at its original path, cut to the dumped size.
        tracked = snap_mod.fetch(store, info.manifest, str(tmp_path / "restored"))
        assert tracked == [TrackedFile(str(tmp_path / "out.log"), 14)]
        assert (tmp_path / "out.log").read_bytes() == b"step 1\nstep 2\n"
        assert sorted(os.listdir(tmp_path / "restored" / "images")) == [
            "files.img", "pages-1.img", "stats-dump"]  # CRIU's log is not kept

        # A second entry of the same attempt, spooled with the same stale last_seq: the
        # uploader adopts its own earlier commit and goes on from there.
        second = _spooled(spool, store.url, attempt, tmp_path / "out.log")
        assert second.last_seq == ticket.last_seq
        again = spool_mod.upload(store, spool, second)
        assert again.seq == result.seq + 1
        assert [i.seq for i in store.snapshots(KEY)] == [again.seq, result.seq]


@pytest.mark.parametrize("carried", [True, False])
def test_the_uploader_carries_page_deltas_from_one_spooled_dump_to_the_next(
        tmp_path: Path, carried: bool) -> None:
    import random

    pages = bytearray(random.Random(1).randbytes(16 * 32768))
    changed = bytearray(pages)
    for page in (3, 40, 41):  # in 32 KiB chunks 0 and 5
        changed[page * 4096:(page + 1) * 4096] = random.Random(page).randbytes(4096)
    deltas: dict[tuple[str, ...], object] | None = {} if carried else None
    with open_store(str(tmp_path / "store")) as store:
        attempt = store.open_attempt(KEY)
        spool = Spool(str(tmp_path / "spool"))
        results = []
        for data in (pages, changed):
            entry = spool.new_entry(attempt.epoch)
            fake_dump(spool.images_dir(entry), pages=bytes(data), pages_at=0x7F0000000000)
            ticket = spool.hand_off(entry, key=KEY, store=store.url, epoch=attempt.epoch,
                                    last_seq=attempt.log.last_seq, parent_seq=None,
                                    compat={}, info={}, tracked_paths=[])
            results.append(spool_mod.upload(store, spool, ticket, deltas=deltas))  # type: ignore[arg-type]
        manifest = store.manifest(KEY, results[1].seq)
        chunks = manifest.file("images/pages-1.img").chunks
        if carried:
            assert [i for i, c in enumerate(chunks) if c.is_delta] == [0, 5]
            assert results[1].bytes_written < 4 * 4096 + 4096  # 3 pages and the small images
        else:
            assert not any(c.is_delta for c in chunks), "a fresh attempt object knows no bases"
            assert results[1].bytes_written >= 2 * 32768
        assert store.reader(manifest).read_file("images/pages-1.img") == bytes(changed)


def test_a_ticket_from_a_fenced_attempt_is_dropped(tmp_path: Path) -> None:
    with open_store(str(tmp_path / "store")) as store:
        old = store.open_attempt(KEY)
        spool = Spool(str(tmp_path / "spool"))
        ticket = _spooled(spool, store.url, old, tmp_path / "out.log")
        newer = store.open_attempt(KEY)  # the retry opened: the old attempt is fenced
        result = spool_mod.upload(store, spool, ticket)
        assert result.outcome is UploadOutcome.FENCED and result.seq is None
        assert "newer attempt" in result.detail
        assert store.snapshots(KEY) == []
        assert [r.kind for r in store.history(KEY)] == [RecordKind.OPEN, RecordKind.OPEN]
        assert newer.epoch > old.epoch


def test_no_snapshot_is_committed_after_the_attempts_done(tmp_path: Path) -> None:
    with _one_spooled(tmp_path) as (store, attempt, spool, ticket):
        attempt.finish()  # the step succeeded before the uploader got to the entry
        result = spool_mod.upload(store, spool, ticket)
        assert result.outcome is UploadOutcome.FINISHED
        assert [r.kind for r in store.history(KEY)] == [RecordKind.OPEN, RecordKind.DONE]
        assert store.snapshots(KEY) == []


def test_a_done_that_lands_during_the_upload_wins(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor marks the key done while the uploader is writing packs: the uploader's
    snap record loses the create race at that seq, and says the step finished."""
    with _one_spooled(tmp_path) as (store, attempt, spool, ticket):
        real = snap_mod.commit_dump

        def finish_first(*args: object, **kwargs: object) -> object:
            hook = kwargs["before_commit"]

            def then_done() -> None:
                hook()  # type: ignore[operator]
                attempt.finish()

            return real(*args, **{**kwargs, "before_commit": then_done})  # type: ignore[arg-type]

        monkeypatch.setattr(spool_mod, "commit_dump", finish_first)
        result = spool_mod.upload(store, spool, ticket)
        assert result.outcome is UploadOutcome.FINISHED
        assert [r.kind for r in store.history(KEY)] == [RecordKind.OPEN, RecordKind.DONE]


def test_an_entry_withdrawn_during_the_upload_is_not_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _one_spooled(tmp_path) as (store, attempt, spool, ticket):
        real = snap_mod.commit_dump

        def cancel_midway(*args: object, **kwargs: object) -> object:
            spool.cancel(ticket.entry)
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(spool_mod, "commit_dump", cancel_midway)
        assert spool_mod.upload(store, spool, ticket).outcome is UploadOutcome.CANCELLED
        assert store.snapshots(KEY) == []


def test_upload_is_idempotent_when_the_commit_landed_unreported(tmp_path: Path) -> None:
    with _one_spooled(tmp_path) as (store, attempt, spool, ticket):
        first = spool_mod.upload(store, spool, ticket)
        # The uploader died after the commit, before it wrote the result: the entry is
        # still there, and a restarted uploader takes it again.
        second = spool_mod.upload(store, spool, ticket)
        assert second.outcome is UploadOutcome.COMMITTED and second.seq == first.seq
        assert "before this uploader could report it" in second.detail
        assert [i.seq for i in store.snapshots(KEY)] == [first.seq]


# -- the supervisor's side of "done" ---------------------------------------------------------

def test_the_supervisor_marks_done_past_the_uploaders_commits(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's own log position is stale (the sidecar committed); an upload that was in
    flight even takes the seq after it caught up. Its done lands last, and drops everything."""
    with open_store(str(tmp_path / "store")) as store:
        supervisor, spool = _supervisor(store, tmp_path)
        supervisor.ctx.attempt = attempt = store.open_attempt(KEY)
        supervisor.dumper.spool = spool  # type: ignore[assignment]
        committed = spool_mod.upload(store, spool, _spooled(spool, store.url, attempt,
                                                            tmp_path / "out.log"))
        in_flight = _spooled(spool, store.url, attempt, tmp_path / "out.log")
        real_catch_up = attempt.log.catch_up

        def catch_up_then_race() -> None:
            real_catch_up()
            monkeypatch.setattr(attempt.log, "catch_up", real_catch_up)
            spool_mod.upload(store, spool, in_flight)  # lands between catch-up and done

        monkeypatch.setattr(attempt.log, "catch_up", catch_up_then_race)
        supervisor._finish_attempt()
        kinds = [(r.seq, r.kind) for r in store.history(KEY)]
        assert kinds[-1][1] is RecordKind.DONE
        assert kinds[-1][0] == committed.seq + 2  # after both of the uploader's snaps
        assert store.snapshots(KEY) == []
        # And the uploader refuses anything of this attempt from now on.
        late = _spooled(spool, store.url, attempt, tmp_path / "out.log")
        assert spool_mod.upload(store, spool, late).outcome is UploadOutcome.FINISHED


def test_fenced_means_the_supervisor_stops(tmp_path: Path) -> None:
    with open_store(str(tmp_path / "store")) as store:
        supervisor, spool = _supervisor(store, tmp_path)
        supervisor.ctx.attempt = store.open_attempt(KEY)
        client = supervisor.dumper.spool = SpoolClient(spool,
                                                       account=supervisor.dumper.account_upload)
        client.epoch = supervisor.ctx.attempt.epoch
        store.open_attempt(KEY)
        with pytest.raises(Fenced):
            supervisor._finish_attempt()
        ticket = _spooled(spool, store.url, supervisor.ctx.attempt, tmp_path / "out.log")
        spool.write_result(spool_mod.upload(store, spool, ticket))
        supervisor.dumper.poll_spool()
        assert client.fenced is not None
        assert client.fenced.entry == ticket.entry
        shutil.rmtree(spool.path)


def test_a_starting_run_lets_the_uploader_finish_an_earlier_runs_entries(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Opening an attempt fences the older ones, so a restarted supervisor first gives the
    uploader (here a real one, in a thread) time to commit what its predecessor spooled, and
    clears away the predecessor's half-written dump."""
    from cairn.k8s.uploader import Uploader, UploadSettings

    with open_store(str(tmp_path / "store")) as store:
        spool_dir = str(tmp_path / "spool")
        earlier = store.open_attempt(KEY)
        spool = Spool(spool_dir)
        ticket = _spooled(spool, store.url, earlier, tmp_path / "out.log")
        half = spool.new_entry(earlier.epoch)
        fake_dump(spool.images_dir(half))
        uploader = Uploader(UploadSettings(spool_dir=spool_dir, poll_s=0.05))
        supervisor = Supervisor(RunSettings(store=store.url, key=str(KEY), argv=("true",),
                                            spool_dir=spool_dir, spool_wait_s=30))
        # The uploader's heartbeat says it is alive; its uploads start once the supervisor
        # waits for it. Started before, it may have committed the entry before the supervisor
        # looked, and then nothing is waited for (seen on a loaded CI machine).
        spool.write_heartbeat({"pid": os.getpid(), "pending": 1})
        starter = _StartWhenLogged(uploader.start, "waiting up to 30s for the sidecar")
        logging.getLogger("cairn.run").addHandler(starter)
        try:
            with caplog.at_level("WARNING", logger="cairn.run"):
                supervisor.dumper.spool = SpoolClient.prepare(
                    spool_dir, wait_s=30, account=supervisor.dumper.account_upload)
        finally:
            logging.getLogger("cairn.run").removeHandler(starter)
            if starter.started:
                uploader.stop()
        assert "waiting up to 30s for the sidecar to upload 1 snapshot(s)" in caplog.text
        assert supervisor.dumper.spool is not None and spool.entries() == []
        (info,) = store.snapshots(KEY)
        assert info.epoch == earlier.epoch
        assert snap_mod.process_info(info.manifest)["spool_entry"] == ticket.entry


class _StartWhenLogged(logging.Handler):
    """Calls ``start`` (once) when a record containing ``text`` is logged."""

    def __init__(self, start: Callable[[], None], text: str) -> None:
        super().__init__(level=logging.DEBUG)
        self._start, self._text, self.started = start, text, False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.started and self._text in record.getMessage():
            self.started = True
            self._start()


def test_a_final_dump_that_would_not_fit_withdraws_pending_entries(tmp_path: Path) -> None:
    with open_store(str(tmp_path / "store")) as store:
        supervisor, spool = _supervisor(store, tmp_path)
        attempt = store.open_attempt(KEY)
        client = SpoolClient(spool, account=supervisor.dumper.account_upload)
        client.epoch = attempt.epoch
        pending = _spooled(spool, store.url, attempt, tmp_path / "out.log").entry
        client.make_room(1 << 20)  # this disk has room for another MiB: kept
        assert spool.pending() == [pending]
        client.make_room(1 << 62)  # no volume holds this next to it
        assert spool.pending() == [] and spool.entries() == []
