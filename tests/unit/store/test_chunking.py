"""Chunk boundaries follow caller cuts, and a change inside one segment shifts only it."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.store.chunking import chunk_spans, segments


def test_fixed_size_without_cuts() -> None:
    assert list(chunk_spans(10, max_chunk=4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(chunk_spans(0, max_chunk=4)) == []


def test_every_cut_starts_a_chunk() -> None:
    spans = list(chunk_spans(20, cuts=[3, 3, 10], max_chunk=4))
    assert spans == [(0, 3), (3, 7), (7, 10), (10, 14), (14, 18), (18, 20)]
    assert {s for s, _ in spans} >= {0, 3, 10}


def test_growing_one_segment_leaves_later_chunks_aligned() -> None:
    before = list(chunk_spans(30, cuts=[10, 20], max_chunk=4))
    after = list(chunk_spans(35, cuts=[15, 25], max_chunk=4))  # segment 1 grew by 5 bytes
    later_before = [(s - 20, e - 20) for s, e in before if s >= 20]
    later_after = [(s - 25, e - 25) for s, e in after if s >= 25]
    assert later_before == later_after


@pytest.mark.parametrize("cuts", [[5, 2], [-1], [11], [1.5]])
def test_bad_cuts_are_rejected(cuts: list[object]) -> None:
    with pytest.raises(ConfigError, match="increasing offset"):
        segments(10, cuts)  # type: ignore[arg-type]
