"""Page deltas on every backend: a chunk that changed in a few pages is stored as those pages
over the previous snapshot's chunk at the same locator; every read path (streaming, into
memory, lazy chunk reads, restore, verify) assembles and verifies it, damage in either of its
two extents is caught and never returned, and garbage collection keeps the base's pack."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store import Key, Manifest, Store
from cairn.store.delta import DELTA_PAGE
from tests.support import tamper

KEY = Key(("dag", "deltas", "run-1", "0"))
CHUNK = 8 * DELTA_PAGE
CHUNKS = 16
PATH = "images/pages-1.img"


def image(seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(CHUNKS * CHUNK))


def commit(attempt, data: bytes, step: int, *, locators: bool = True,  # noqa: ANN001
           last: bool = False) -> Manifest:
    cuts = list(range(0, len(data), CHUNK))
    with attempt.snapshot(last=last) as snap:
        snap.add_bytes("meta.json", b'{"small": true}')
        snap.add_bytes(PATH, data, cuts=cuts,
                       locators=[0x7F0000000000 + c for c in cuts] if locators else None)
        return snap.commit(step=step)


def scatter(data: bytearray, pages: list[int], seed: int) -> bytearray:
    changed = bytearray(data)
    for page in pages:
        changed[page * DELTA_PAGE:(page + 1) * DELTA_PAGE] = random.Random(seed + page).randbytes(DELTA_PAGE)
    return changed


# pages 3, 20 and 21 (chunks 0 and 2), and 5 of chunk 4's 8 pages: a whole chunk is cheaper
PAGES = [3, 20, 21] + [32 + p for p in range(5)]


def two_snapshots(store: Store) -> tuple[Manifest, Manifest, bytes]:
    attempt = store.open_attempt(KEY)
    first_data = image(1)
    first = commit(attempt, first_data, 1)
    second_data = scatter(first_data, PAGES, 100)
    return first, commit(attempt, second_data, 2), bytes(second_data)


def test_changed_pages_are_stored_as_deltas_of_the_previous_chunk(store: Store) -> None:
    first, second, data = two_snapshots(store)
    chunks = second.file(PATH).chunks
    deltas = [i for i, c in enumerate(chunks) if c.is_delta]
    assert deltas == [0, 2]
    assert [chunks[i].delta_mask for i in deltas] == [1 << 3, (1 << 4) | (1 << 5)]
    base = first.file(PATH).chunks
    assert all((chunks[i].base_pack, chunks[i].base_offset) == (base[i].pack, base[i].offset)
               for i in deltas)
    assert not chunks[4].is_delta and chunks[4].pack not in first.packs(), "written whole"
    assert second.bytes_written == 3 * DELTA_PAGE + CHUNK
    assert second.metadata["chunks_delta"] == 2


def test_every_read_path_assembles_and_verifies_a_delta(store: Store, tmp_path: Path) -> None:
    first, second, data = two_snapshots(store)
    reader = store.reader(second)
    assert b"".join(bytes(piece) for piece in reader.iter_file(PATH)) == data
    assert bytes(reader.read_chunks(second.file(PATH).chunks)) == data
    assert bytes(reader.read_chunks(second.file(PATH).chunks[2:5])) == data[2 * CHUNK:5 * CHUNK]
    # Into memory reused run after run (a streamed restore's windows): what an earlier run
    # left there is overwritten, and only the run's own bytes are returned.
    reused = memoryview(bytearray(b"\xee" * (len(data) + DELTA_PAGE)))
    for start, end in ((0, CHUNKS), (2, 5), (0, 3)):
        got = reader.read_chunks(second.file(PATH).chunks[start:end], into=reused)
        assert bytes(got) == data[start * CHUNK:end * CHUNK]
    with pytest.raises(ValueError, match="writable bytes"):
        reader.read_chunks(second.file(PATH).chunks, into=memoryview(bytes(len(data))))
    with pytest.raises(ValueError, match="writable bytes"):
        reader.read_chunks(second.file(PATH).chunks, into=reused[:CHUNK])
    buffer = bytearray(len(data))
    reader.read_files_into([(PATH, memoryview(buffer))])
    assert buffer == data
    reader.restore_to(tmp_path / "out", durable=True)
    assert (tmp_path / "out" / PATH).read_bytes() == data
    assert store.verify(KEY).ok


def test_a_third_snapshot_takes_its_delta_against_the_full_chunk_not_the_delta(
        store: Store) -> None:
    attempt = store.open_attempt(KEY)
    data = image(2)
    first = commit(attempt, data, 1)
    data = scatter(data, [1], 7)
    commit(attempt, data, 2)
    data = scatter(data, [2], 8)
    third = commit(attempt, data, 3)
    chunk = third.file(PATH).chunks[0]
    assert chunk.is_delta and chunk.delta_mask == 0b110, "pages changed since the base"
    assert (chunk.base_pack, chunk.base_offset) == (first.file(PATH).chunks[0].pack,
                                                    first.file(PATH).chunks[0].offset)
    assert bytes(store.reader(third).read_file(PATH)) == data


def test_a_last_snapshot_uses_deltas_but_leaves_none_for_a_snapshot_after_it(
        store: Store) -> None:
    """``last=True`` (a try's final snapshot): its changed chunks are still stored as deltas
    of the parent's, but it computes no page hashes of its own new chunks, so a snapshot
    that does follow it (which a final one never has) writes changed chunks whole."""
    attempt = store.open_attempt(KEY)
    data = image(4)
    commit(attempt, data, 1)
    data = scatter(data, [3], 11)
    final = commit(attempt, data, 2, last=True)
    assert final.file(PATH).chunks[0].is_delta and final.bytes_written == DELTA_PAGE
    data = scatter(data, [40], 12)  # chunk 5, unchanged in the last snapshot: no page hashes
    after = commit(attempt, data, 3)
    assert not after.file(PATH).chunks[5].is_delta and after.bytes_written == CHUNK
    assert bytes(store.reader(after).read_file(PATH)) == data


def test_without_locators_nothing_is_a_delta(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    data = image(3)
    commit(attempt, data, 1, locators=False)
    second = commit(attempt, scatter(data, [3], 9), 2, locators=False)
    assert not any(c.is_delta for c in second.file(PATH).chunks)
    assert second.bytes_written == CHUNK


@pytest.mark.parametrize("where", ["pages", "base"])
def test_damage_in_either_extent_of_a_delta_is_caught_on_every_path(
        store: Store, tmp_path: Path, where: str) -> None:
    first, second, data = two_snapshots(store)
    chunk = second.file(PATH).chunks[0]
    # The base's page 0 is not among the changed pages, so damage there reaches the chunk.
    pack, offset = ((chunk.pack, chunk.offset + 9) if where == "pages"
                    else (chunk.base_pack, chunk.base_offset + 9))
    tamper.flip_byte(store.backend, pack, offset)
    reader = store.reader(second)
    with pytest.raises(CorruptSnapshot, match=chunk.digest):
        reader.restore_to(tmp_path / "bad", durable=False)
    assert not (tmp_path / "bad").exists(), "nothing half-written is left"
    with pytest.raises(CorruptSnapshot, match=chunk.digest):
        reader.read_chunks(second.file(PATH).chunks[:2])
    with pytest.raises(CorruptSnapshot, match=chunk.digest):
        reader.read_file(PATH)
    assert not store.verify(KEY).ok
    assert chunk.digest in store.verify(KEY).bad_chunks


def test_gc_keeps_the_base_pack_of_a_retained_delta(store: Store) -> None:
    first, second, data = two_snapshots(store)
    store.prune(KEY, keep=1)  # the first snapshot's record goes; its pack is a base
    store.gc(grace_seconds=0)
    assert bytes(store.reader(second).read_file(PATH)) == data


def test_a_delta_kept_unchanged_through_a_snapshot_still_knows_its_base(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    data = image(4)
    first = commit(attempt, data, 1)
    data = scatter(data, [1], 10)
    second = commit(attempt, data, 2)
    data = scatter(data, [9], 11)  # chunk 1 changes; chunk 0 stays the delta it was
    third = commit(attempt, data, 3)
    assert third.file(PATH).chunks[0] == second.file(PATH).chunks[0]
    data = scatter(data, [2], 12)
    fourth = commit(attempt, data, 4)
    chunk = fourth.file(PATH).chunks[0]
    assert chunk.is_delta and chunk.delta_mask == 0b110
    assert chunk.base_offset == first.file(PATH).chunks[0].offset
    assert bytes(store.reader(fourth).read_file(PATH)) == data
