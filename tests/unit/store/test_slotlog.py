"""The slot log's reads: a record decoded once per content, never served stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store import Key
from cairn import open_store
from cairn.store import slotlog
from cairn.store.slotlog import record_name

KEY = Key(("dag", "train", "run-1", "0"))


def test_a_record_is_decoded_once_and_read_again_as_stored_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = []
    real = slotlog.decode_record

    def counting(data: bytes, *, seq: int) -> slotlog.Record:
        decoded.append(seq)
        return real(data, seq=seq)

    monkeypatch.setattr(slotlog, "decode_record", counting)
    with open_store(str(tmp_path / "store")) as store:
        with store.open_attempt(KEY).snapshot() as snap:
            snap.add_bytes("state.json", b'{"step": 1}')
            manifest = snap.commit(step=1)
        log = store.log(KEY)
        first = log.read(manifest.seq)
        assert [s.seq for s in store.snapshots(KEY)] == [manifest.seq]
        assert store.log(KEY).read(manifest.seq) is first
        assert decoded.count(manifest.seq) == 1, "the same bytes were parsed again"

        # The cache is keyed by content: a record changed in the store is read as it is now.
        path = tmp_path / "store" / record_name(KEY.path, manifest.seq)
        path.write_bytes(path.read_bytes().replace(b'"kind"', b'"kinds"'))
        with pytest.raises(CorruptSnapshot, match=f"seq {manifest.seq}"):
            log.read(manifest.seq)
        with pytest.raises(CorruptSnapshot):
            log.read(manifest.seq)  # a failure is not remembered either
