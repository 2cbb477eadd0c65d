"""Page deltas: the changed pages are found, gathered and applied back exactly."""

from __future__ import annotations

import random

from cairn.store import delta

PAGE = delta.DELTA_PAGE


def chunk(seed: int, pages: int = 8) -> bytearray:
    return bytearray(random.Random(seed).randbytes(pages * PAGE))


def test_the_mask_names_exactly_the_pages_that_changed() -> None:
    base = chunk(1)
    new = bytearray(base)
    new[2 * PAGE + 5] ^= 1
    new[7 * PAGE] ^= 0xFF
    mask = delta.changed_mask(delta.page_hashes(memoryview(new)),
                              delta.page_hashes(memoryview(base)))
    assert mask == (1 << 2) | (1 << 7)
    assert delta.worth_a_delta(mask, len(new))


def test_gather_then_apply_rebuilds_the_chunk_from_its_base() -> None:
    base = chunk(2)
    new = bytearray(base)
    for page in (0, 3, 4):
        new[page * PAGE:(page + 1) * PAGE] = random.Random(page).randbytes(PAGE)
    mask = 0b11001
    pages = delta.gather(memoryview(new), mask)
    assert len(pages) == 3 * PAGE
    rebuilt = bytearray(base)
    delta.apply(memoryview(rebuilt), memoryview(pages), mask)
    assert rebuilt == new


def test_a_delta_is_not_worth_it_past_half_the_pages_or_for_no_change() -> None:
    assert not delta.worth_a_delta(0, 8 * PAGE)
    assert delta.worth_a_delta(0b1111, 8 * PAGE)
    assert not delta.worth_a_delta(0b11111, 8 * PAGE)


def test_only_whole_multi_page_chunks_are_eligible() -> None:
    assert delta.delta_eligible(8 * PAGE)
    assert not delta.delta_eligible(PAGE)  # one page: a delta would be the whole chunk
    assert not delta.delta_eligible(8 * PAGE + 1)
    assert not delta.delta_eligible((delta.MAX_DELTA_PAGES + 1) * PAGE)
