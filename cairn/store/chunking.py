"""Where chunks begin: at caller-given cuts, then every ``max_chunk`` bytes after each cut.

Boundaries follow the data: a tensor, or a CRIU pagemap entry, starts its own chunk, so
inserting one somewhere shifts only the chunks of its own segment, not every later one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cairn.exceptions import ConfigError


def segments(total: int, cuts: Iterable[int] = ()) -> list[tuple[int, int]]:
    """``(start, end)`` of each segment between the cuts. Cuts must be increasing, in range."""
    bounds = [0]
    for cut in cuts:
        if not isinstance(cut, int) or cut < bounds[-1] or cut > total:
            raise ConfigError(
                f"chunk cut {cut!r} is not an increasing offset within 0..{total}; "
                "pass sorted byte offsets inside the data"
            )
        if cut != bounds[-1]:
            bounds.append(cut)
    if bounds[-1] != total:
        bounds.append(total)
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def chunk_spans(total: int, *, cuts: Iterable[int] = (), max_chunk: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each chunk of ``total`` bytes (see the module docstring)."""
    if max_chunk <= 0:
        raise ConfigError("max_chunk must be positive")
    for start, end in segments(total, cuts):
        for offset in range(start, end, max_chunk):
            yield offset, min(offset + max_chunk, end)
