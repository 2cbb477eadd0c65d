"""The dense chunk table (manifest schema 2): every field round-trips, and decoding trusts
nothing — truncation, unknown flags, bad indexes, masks and sizes are all rejected."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cairn.store import chunktable
from cairn.store.chunktable import ChunkRef, TableError

PACKS = ["packs/aa/one", "packs/bb/two", "packs/cc/three"]
INDEX = {name: i for i, name in enumerate(PACKS)}


def decode(text: str) -> list[ChunkRef]:
    return chunktable.decode(text, packs=PACKS, max_size=1 << 32, max_offset=1 << 50)


digests = st.binary(min_size=32, max_size=32).map(bytes.hex)
full = st.builds(lambda digest, size, pack, offset: ChunkRef(digest, size, pack, offset),
                 digests, st.integers(0, 1 << 30), st.sampled_from(PACKS), st.integers(0, 1 << 40))


@st.composite
def delta_chunks(draw: st.DrawFn) -> ChunkRef:
    pages = draw(st.integers(2, 64))
    return ChunkRef(draw(digests), pages * 4096, draw(st.sampled_from(PACKS)),
                    draw(st.integers(0, 1 << 40)), draw(st.sampled_from(PACKS)),
                    draw(st.integers(0, 1 << 40)), draw(st.integers(1, (1 << pages) - 1)))


@given(st.lists(st.one_of(full, delta_chunks()), max_size=40))
def test_any_list_of_chunks_round_trips(chunks: list[ChunkRef]) -> None:
    assert decode(chunktable.encode(chunks, INDEX)) == chunks


def test_chunks_stored_one_after_another_cost_about_35_bytes_each() -> None:
    chunks = [ChunkRef(f"{i:064x}", 32768, PACKS[0], i * 32768) for i in range(1000)]
    raw = base64.b64decode(chunktable.encode(chunks, INDEX))
    assert len(raw) <= 1000 * 35 + 3  # flags, digest, pack, offset (the size said once)
    assert decode(chunktable.encode(chunks, INDEX)) == chunks


def encoded(*chunks: ChunkRef) -> bytes:
    return base64.b64decode(chunktable.encode(list(chunks), INDEX))


DELTA = ChunkRef("ab" * 32, 8 * 4096, PACKS[1], 0, PACKS[0], 4096, 0b1001)


@pytest.mark.parametrize("raw, message", [
    (encoded(DELTA)[:-1], "truncated"),
    (encoded(DELTA)[:20], "truncated"),
    (bytes([0x80]) + encoded(DELTA)[1:], "unknown flags"),
    (bytes([chunktable.FLAG_SAME_SIZE]) + encoded(DELTA)[1:], "no size"),
    (encoded(ChunkRef("ab" * 32, 8 * 4096, PACKS[1], 0, PACKS[0], 0, 1 << 8)), "bad page mask"),
    (encoded(ChunkRef("ab" * 32, 8 * 4096 + 1, PACKS[1], 0, PACKS[0], 0, 1)), "whole number"),
    (encoded(ChunkRef("ab" * 32, 5, "packs/cc/three", 0)), "names pack 2 of 2"),
])
def test_malformed_tables_are_rejected_with_the_place(raw: bytes, message: str) -> None:
    packs = PACKS[:2] if "of 2" in message else PACKS
    with pytest.raises(TableError, match=message):
        chunktable.decode(base64.b64encode(raw).decode(), packs=packs, max_size=1 << 32,
                          max_offset=1 << 50)


def test_offsets_and_sizes_beyond_the_limits_are_rejected() -> None:
    text = chunktable.encode([ChunkRef("ab" * 32, 1 << 20, PACKS[0], 1 << 45)], INDEX)
    with pytest.raises(TableError, match="size"):
        chunktable.decode(text, packs=PACKS, max_size=1 << 19, max_offset=1 << 50)
    with pytest.raises(TableError, match="offset"):
        chunktable.decode(text, packs=PACKS, max_size=1 << 32, max_offset=1 << 40)


@pytest.mark.parametrize("text", ["not base64!", 7, "ab\u00e9"])
def test_a_table_that_is_not_base64_text_is_rejected(text: object) -> None:
    with pytest.raises(TableError):
        chunktable.decode(text, packs=PACKS, max_size=1 << 32, max_offset=1 << 50)
