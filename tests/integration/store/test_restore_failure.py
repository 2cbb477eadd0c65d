"""A store restore (``Store.restore``, what ``cairn get`` runs; ``latest_good``) that fails on
its own side, with an injected library failure, ends with RestoreFailed and skips nothing:
no snapshot is passed over, nothing is left in the destination, and every snapshot restores
once the injection is gone (issue 32 item 4). A rank part that fails to be read is no
"unreadable part" either: GC and ``commit_parts`` stop on it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cairn.exceptions import RestoreFailed
from cairn.store import Key, SnapshotMode, Store
from cairn import open_store
from cairn.store.keyring import new_secret
from cairn.store.slotlog import parts_prefix
from tests.support.read_failure import INJECTED, failing_reads

KEY = Key.parse("dag/get/run-1/0")


def three_snapshots(store: Store) -> list[int]:
    """Three committed snapshots of KEY (file ``data`` of 200 KiB each); newest seq first."""
    attempt = store.open_attempt(KEY)
    for step in range(3):
        with attempt.snapshot(mode=SnapshotMode.FILES) as snap:
            snap.add_bytes("data", bytes([step + 1]) * (200 << 10))
            snap.commit(step=step)
    return [info.seq for info in store.snapshots(KEY)]


@pytest.mark.parametrize("where", ["part", "decrypt"])
def test_a_library_failure_ends_the_restore_and_skips_nothing(
        tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture) -> None:
    secret = new_secret() if where == "decrypt" else None
    with open_store(str(tmp_path / "store"), secret=secret) as store:
        seqs = three_snapshots(store)
        dest = tmp_path / "dest"
        with failing_reads(where), caplog.at_level(logging.WARNING), \
                pytest.raises(RestoreFailed) as caught:
            store.restore(KEY, dest)
        assert caught.value.seq == seqs[0], "the newest was tried, and only it"
        assert f"ValueError: {INJECTED}" in str(caught.value)
        assert isinstance(caught.value.__cause__, ValueError)
        assert not any("skip" in r.getMessage() for r in caplog.records), caplog.text
        assert not dest.exists() and not list(tmp_path.glob(".dest.cairn-partial-*"))
        with failing_reads(where), pytest.raises(RestoreFailed):
            store.latest_good(KEY, deep=True)

        assert [info.seq for info in store.snapshots(KEY)] == seqs
        assert store.verify(KEY).ok
        result = store.restore(KEY, dest)
        assert result.manifest.seq == seqs[0] and result.skipped == ()
        assert (dest / "data").read_bytes() == bytes([3]) * (200 << 10)
        assert store.latest_good(KEY, deep=True).seq == seqs[0]


def test_a_library_failure_reading_a_part_stops_gc_and_commit_parts_not_ignored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank part in flight protects its packs from GC; one that fails to *read* (not to
    parse) must stop the pass, never count as unreadable and leave its packs unprotected."""
    with open_store(str(tmp_path / "store")) as store:
        attempt = store.open_attempt(KEY)
        seq = attempt.log.next_seq
        with attempt.snapshot(mode=SnapshotMode.STATE) as snap:
            snap.add_bytes("state.bin", b"x" * 4096)
            snap.commit_part(seq=seq, rank=0)
        reading = store.backend.read

        def failing(name: str) -> bytes:
            if name.startswith(parts_prefix(KEY.path)):
                raise ValueError(INJECTED)
            return reading(name)

        monkeypatch.setattr(store.backend, "read", failing)
        with pytest.raises(ValueError, match="injected"):
            store.gc(grace_seconds=3600)
        with pytest.raises(ValueError, match="injected"):
            attempt.commit_parts(seq, world_size=1)
        monkeypatch.undo()

        assert store.gc(grace_seconds=3600).unreadable_records == []
        assert attempt.commit_parts(seq, world_size=1).seq == seq
