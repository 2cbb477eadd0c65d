"""Corruption is detected inside the restore pass and never loaded: a bad newest snapshot falls
back to the previous good one; a bad chunk every snapshot shares is named with its seqs."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from cairn.exceptions import NoSnapshot
from cairn.store import Key, Manifest, Store
from cairn.store.slotlog import record_name
from tests.support import tamper

KEY = Key(("dag", "train", "run-1", "0"))
SHARED = random.Random(0).randbytes(200_000)


def three_snapshots(store: Store) -> list[Manifest]:
    attempt = store.open_attempt(KEY)
    out = []
    for step in (1, 2, 3):
        with attempt.snapshot() as snap:
            snap.add_bytes("shared.bin", SHARED)
            snap.add_bytes("step.bin", random.Random(step).randbytes(100_000))
            out.append(snap.commit(step=step))
    return out


def unique_chunk(newest: Manifest, older: Manifest):  # noqa: ANN201
    old = {c.digest for c in older.chunk_refs()}
    return next(c for c in newest.chunk_refs() if c.digest not in old)


def flip(store: Store, m: list[Manifest]) -> None:
    chunk = unique_chunk(m[2], m[1])
    tamper.flip_byte(store.backend, chunk.pack, chunk.offset + 17)


def truncate(store: Store, m: list[Manifest]) -> None:
    chunk = unique_chunk(m[2], m[1])
    tamper.truncate(store.backend, chunk.pack, chunk.offset + chunk.size // 2)


def delete(store: Store, m: list[Manifest]) -> None:
    store.backend.delete(unique_chunk(m[2], m[1]).pack)


def garble(store: Store, m: list[Manifest]) -> None:
    tamper.overwrite(store.backend, record_name(KEY.path, m[2].seq), b'{"schema": "cairn.rec')


def swap_tables(store: Store, m: list[Manifest]) -> None:
    """The newest record rewritten with its two files' chunk tables swapped, as a writer
    holding the store's secret could: every table decodes, but no file's chunks add up to its
    size. The record parses (tables are decoded at first use, ADR 0044); its chunks do not."""
    name = record_name(KEY.path, m[2].seq)
    doc = json.loads(json.dumps(store.log(KEY).read(m[2].seq).body))
    files = doc["manifest"]["files"]
    files[0]["chunks"], files[1]["chunks"] = files[1]["chunks"], files[0]["chunks"]
    tamper.overwrite_record(store, name, json.dumps(doc).encode())


@pytest.mark.parametrize("damage", [flip, truncate, delete, garble, swap_tables],
                         ids=lambda f: f.__name__)
def test_damage_unique_to_newest_falls_back_to_previous(store: Store, tmp_path,
                                                        damage: Callable[[Store, list[Manifest]], None]) -> None:
    m = three_snapshots(store)
    damage(store, m)
    result = store.restore(KEY, tmp_path / "out")
    assert result.manifest.seq == m[1].seq
    assert (tmp_path / "out" / "step.bin").read_bytes() == random.Random(2).randbytes(100_000)
    assert (tmp_path / "out" / "shared.bin").read_bytes() == SHARED
    if damage is not garble:  # a garbled record is not listed as a snapshot at all
        assert [s for s, _ in result.skipped] == [m[2].seq]
        report = store.verify(KEY)
        assert report.results[m[2].seq] is not None and report.results[m[1].seq] is None
        assert not report.ok
    assert store.latest_good(KEY, deep=True).seq == m[1].seq
    assert not list((tmp_path).glob(".out.cairn-partial-*")), "no partial restore left behind"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damage_shared_by_all_is_reported_with_its_seqs(store: Store, tmp_path, damage: str) -> None:
    m = three_snapshots(store)
    shared = m[0].file("shared.bin").chunks[1]
    assert all(shared in s.file("shared.bin").chunks for s in m)
    if damage == "flip":
        tamper.flip_byte(store.backend, shared.pack, shared.offset)
    else:
        tamper.truncate(store.backend, shared.pack, shared.offset + 10)
    with pytest.raises(NoSnapshot) as err:
        store.restore(KEY, tmp_path / "out")
    message = str(err.value)
    assert f"chunk {shared.digest}, referenced by seq {m[0].seq}..{m[2].seq}" in message
    assert "every retained snapshot" in message
    assert not (tmp_path / "out").exists()
    report = store.verify(KEY)
    reason, seqs = report.bad_chunks[shared.digest]
    assert sorted(seqs) == [s.seq for s in m]
    assert all(report.results[s.seq] is not None for s in m)


def test_flipped_byte_passes_cheap_check_but_not_deep(store: Store) -> None:
    m = three_snapshots(store)
    flip(store, m)
    assert store.latest_good(KEY).seq == m[2].seq
    assert store.latest_good(KEY, deep=True).seq == m[1].seq


def test_gc_reports_a_snapshot_whose_chunk_table_does_not_decode(store: Store) -> None:
    """GC reads every snapshot's packs; one whose table does not decode is listed among the
    unreadable records (its snapshot cannot be restored), as a record that does not parse."""
    m = three_snapshots(store)
    swap_tables(store, m)
    report = store.gc(grace_seconds=3600, dry_run=True)
    assert any(f"seq {m[2].seq}" in line and "add up to" in line
               for line in report.unreadable_records), report.unreadable_records
