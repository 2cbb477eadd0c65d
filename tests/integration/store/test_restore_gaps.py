"""A restore reads over the holes a newer snapshot leaves in its parent's packs: one ranged read
per span instead of one per chunk, only the chunks written out and verified, damage inside a
chunk still detected and damage in a hole (another snapshot's bytes) not this restore's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store import Key, Manifest, Store
from cairn.store.reader import _coalesce, _plan, _spans
from cairn.store.sealing import TAG_BYTES
from tests.support import tamper

KEY = Key(("dag", "gaps", "run-1", "0"))
PIECE = 32 << 10
PIECES = [random.Random(n).randbytes(PIECE) for n in range(6)]


def commit(store: Store, attempt, data: bytes, step: int) -> Manifest:  # noqa: ANN001
    with attempt.snapshot() as snap:
        snap.add_bytes("pages.img", data, cuts=range(0, len(data), PIECE))
        return snap.commit(step=step)


def two_snapshots(store: Store) -> tuple[Manifest, Manifest, bytes]:
    attempt = store.open_attempt(KEY)
    first = commit(store, attempt, b"".join(PIECES), 1)
    kept = PIECES[0] + PIECES[2] + PIECES[3] + PIECES[5]  # pieces 1 and 4 dropped
    second = commit(store, attempt, kept, 2)
    return first, second, kept


def test_a_restore_reads_over_the_holes_and_writes_only_the_chunks(store: Store,
                                                                    tmp_path: Path) -> None:
    first, second, kept = two_snapshots(store)
    chunks = second.file("pages.img").chunks
    assert len({c.pack for c in chunks}) == 1, "every chunk dedups into the first pack"
    tail = TAG_BYTES if store.encrypted else 0  # an encrypted store's tag after each chunk
    assert len(_coalesce(chunks, tail)) == 3, "without gaps: a read per run of adjacent chunks"
    (span,) = _spans(_plan(chunks).direct, tail=tail)
    assert span.payload == len(kept) < span.length
    # output pieces: piece 0, pieces 2 and 3 together (adjacent in the pack and the file;
    # not when a tag lies between them), 5
    together = [(2 * PIECE, PIECE)] if not tail else [(PIECE, PIECE), (PIECE, 2 * PIECE)]
    assert [(length, at) for _, length, at in span.pieces()] == [
        (PIECE, 0), *together, (PIECE, 3 * PIECE)]
    store.reader(second).restore_to(tmp_path / "out", durable=False)
    assert (tmp_path / "out" / "pages.img").read_bytes() == kept
    assert bytes(store.reader(second).read_chunks(chunks)) == kept


def test_damage_in_a_hole_is_not_this_snapshots_but_damage_in_a_chunk_is(
        store: Store, tmp_path: Path) -> None:
    first, second, kept = two_snapshots(store)
    dropped = first.file("pages.img").chunks[1]  # in the hole of the second snapshot's span
    tamper.flip_byte(store.backend, dropped.pack, dropped.offset + 5)
    store.reader(second).restore_to(tmp_path / "ok", durable=False)
    assert (tmp_path / "ok" / "pages.img").read_bytes() == kept
    with pytest.raises(CorruptSnapshot):
        store.reader(first).restore_to(tmp_path / "bad-first", durable=False)
    used = second.file("pages.img").chunks[2]
    tamper.flip_byte(store.backend, used.pack, used.offset + 7)
    with pytest.raises(CorruptSnapshot, match=used.digest):
        store.reader(second).restore_to(tmp_path / "bad", durable=False)
    assert not (tmp_path / "bad").exists(), "nothing half-written is left"
    with pytest.raises(CorruptSnapshot, match=used.digest):
        store.reader(second).read_chunks(second.file("pages.img").chunks)
