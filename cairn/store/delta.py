"""Page deltas: a changed chunk stored as its base chunk plus only the pages that differ.

A training process dirties memory in scattered pages; at 32 KiB chunks, 10% of random pages
touch 57% of the chunks, and each was rewritten whole. A delta chunk stores only its changed
``DELTA_PAGE``-byte pages and names a *full* chunk of the same size as its base (never another
delta: a restore reads at most two extents per chunk). The pages are found by comparing
per-page hashes (XXH3-128, 16 bytes a page) with the base's, which the writer keeps in memory
between snapshots of one try; they only choose what to store. What a reader trusts is the
chunk's BLAKE3 digest over its assembled content, so a hash that missed a change gives a chunk
that fails verification, never wrong data.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import xxhash

from cairn.store.chunktable import DELTA_PAGE, MAX_DELTA_PAGES, ChunkRef

PAGE_HASH_BYTES = 16
# A delta pays a second read at restore; past half the pages, the whole chunk is cheaper.
MAX_CHANGED_FRACTION = 0.5

_hash = xxhash.xxh3_128_digest


@dataclass
class DeltaState:
    """What a try's next page deltas are taken against: valid only on top of snapshot ``seq``
    (the one it was left by). Lives in memory; a process that commits a try's snapshots one
    after another (the spool's uploader) hands it from one to the next.

    ``bases``: locator -> the full chunk there; ``hashes``: page hashes of those chunks, by
    digest; ``delta_bases``: the base of each delta chunk snapshot ``seq`` references."""

    seq: int | None = None
    bases: dict[Hashable, ChunkRef] = field(default_factory=dict)
    hashes: dict[str, bytes] = field(default_factory=dict)
    delta_bases: dict[str, ChunkRef] = field(default_factory=dict)

    def advanced(self, seq: int, bases: dict[Hashable, ChunkRef],
                 delta_bases: dict[str, ChunkRef]) -> DeltaState:
        """The state after snapshot ``seq`` committed with these bases; hashes of chunks no
        longer a base are dropped, so memory stays at one snapshot's."""
        keep = {ref.digest for ref in bases.values()}
        return DeltaState(seq, dict(bases), {d: h for d, h in self.hashes.items() if d in keep},
                          dict(delta_bases))


def delta_eligible(size: int) -> bool:
    return size > DELTA_PAGE and size % DELTA_PAGE == 0 and size <= MAX_DELTA_PAGES * DELTA_PAGE


def page_hashes(data: memoryview) -> bytes:
    """The concatenated per-page hashes of ``data`` (a whole number of pages)."""
    return b"".join([_hash(data[i:i + DELTA_PAGE]) for i in range(0, len(data), DELTA_PAGE)])


def changed_mask(hashes: bytes, base_hashes: bytes) -> int:
    """Bit ``i`` set where page ``i`` differs (both of one chunk size)."""
    mask = 0
    for page, at in enumerate(range(0, len(hashes), PAGE_HASH_BYTES)):
        if hashes[at:at + PAGE_HASH_BYTES] != base_hashes[at:at + PAGE_HASH_BYTES]:
            mask |= 1 << page
    return mask


def worth_a_delta(mask: int, size: int) -> bool:
    return 0 < mask.bit_count() <= (size // DELTA_PAGE) * MAX_CHANGED_FRACTION


def gather(data: memoryview, mask: int) -> bytes:
    """The pages of ``data`` whose bit is set, concatenated in order: what a delta stores."""
    return b"".join([data[page * DELTA_PAGE:(page + 1) * DELTA_PAGE]
                     for page in range(len(data) // DELTA_PAGE) if mask >> page & 1])


def positions(mask: int) -> list[tuple[int, int]]:
    """``(page index in the chunk, offset in the stored pages)`` of each page a delta holds."""
    out = []
    page = taken = 0
    while mask:
        if mask & 1:
            out.append((page, taken))
            taken += DELTA_PAGE
        mask >>= 1
        page += 1
    return out


def apply(chunk: memoryview, pages: memoryview, mask: int) -> None:
    """Overwrite, in ``chunk`` (holding the base's bytes), each page whose bit is set with the
    next page of ``pages``."""
    for page, taken in positions(mask):
        at = page * DELTA_PAGE
        chunk[at:at + DELTA_PAGE] = pages[taken:taken + DELTA_PAGE]
