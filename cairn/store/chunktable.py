"""A file's chunk references as one dense binary table (manifest schema 2).

In JSON each reference cost about 126 bytes (a hex digest, a pack name, two numbers), which made
a process image's manifest 4.1 MiB per GiB at 32 KiB page chunks. The table stores per chunk:

    flags:u8  digest:32 bytes  [size:varint]  pack:varint  offset:zigzag varint
              [base_pack:varint  base_offset:zigzag varint  mask:varint]      (delta chunks)

``size`` is left out (flag ``SAME_SIZE``) when it equals the previous chunk's; ``pack`` is an
index into the manifest's list of packs; an offset is stored relative to the end of the previous
extent this table referenced in the same pack, so chunks stored one after another cost one byte
each. A full chunk is about 35 bytes, a delta chunk about 39: 1.5-1.7 MiB per GiB of image.
The table is base64 in the manifest's JSON. Decoding validates every field; nothing is trusted.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import NamedTuple

DELTA_PAGE = 4096  # a delta chunk replaces whole pages of this size
MAX_DELTA_PAGES = 64  # a mask fits 64 bits; page chunks are 8 pages
FLAG_DELTA = 1
FLAG_SAME_SIZE = 2
_KNOWN_FLAGS = FLAG_DELTA | FLAG_SAME_SIZE
DIGEST_BYTES = 32


class ChunkRef(NamedTuple):
    """Where a chunk's bytes live and what they must hash to.

    A full chunk is ``size`` bytes of ``pack`` at ``offset``. A *delta* chunk
    (``delta_mask`` != 0) is the full chunk of ``size`` bytes at ``base_pack``/``base_offset``
    with the pages whose bit is set in ``delta_mask`` replaced, in order, by the
    ``DELTA_PAGE``-byte pages stored at ``pack``/``offset`` (:mod:`cairn.store.delta`). Either
    way ``digest`` is the BLAKE3 of the chunk's whole content, checked after it is assembled.

    Immutable, and a named tuple rather than a frozen dataclass: a 1 GiB process image has
    ~29,000 of them, and a frozen dataclass took 51 ms to build them against 14 ms, on the
    path of every restore (ADR 0039).
    """

    digest: str
    size: int
    pack: str
    offset: int
    base_pack: str | None = None
    base_offset: int = 0
    delta_mask: int = 0

    @property
    def is_delta(self) -> bool:
        return self.delta_mask != 0

    @property
    def stored_size(self) -> int:
        """Bytes at ``pack``/``offset``: the whole chunk, or a delta's changed pages."""
        return self.delta_mask.bit_count() * DELTA_PAGE if self.delta_mask else self.size

    def extents(self) -> list[tuple[str, int, int]]:
        """``(pack, offset, length)`` of every stored range this chunk is read from."""
        own = (self.pack, self.offset, self.stored_size)
        if self.base_pack is None:
            return [own]
        return [(self.base_pack, self.base_offset, self.size), own]

    def packs(self) -> tuple[str, ...]:
        return (self.pack,) if self.base_pack is None else (self.pack, self.base_pack)


class TableError(ValueError):
    """The table is malformed (the message says where)."""


def _put_varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _zigzag(value: int) -> int:
    return value * 2 if value >= 0 else -value * 2 - 1


def encode(chunks: Sequence[ChunkRef], pack_index: dict[str, int]) -> str:
    """The base64 table of ``chunks``, packs named by their index in ``pack_index``."""
    out = bytearray()
    cursors: dict[int, int] = {}
    previous_size = -1
    for chunk in chunks:
        delta = chunk.delta_mask != 0
        size = chunk.size
        out.append((FLAG_DELTA if delta else 0) | (FLAG_SAME_SIZE if size == previous_size else 0))
        out += bytes.fromhex(chunk.digest)
        if size != previous_size:
            _put_varint(out, size)
        previous_size = size
        pack = pack_index[chunk.pack]
        _put_varint(out, pack)
        _put_varint(out, _zigzag(chunk.offset - cursors.get(pack, 0)))
        cursors[pack] = chunk.offset + chunk.stored_size
        if delta:
            base = pack_index[chunk.base_pack]
            _put_varint(out, base)
            _put_varint(out, _zigzag(chunk.base_offset - cursors.get(base, 0)))
            cursors[base] = chunk.base_offset + size
            _put_varint(out, chunk.delta_mask)
    return base64.b64encode(bytes(out)).decode("ascii")


def _varint(data: bytes, pos: int, index: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise TableError(f"the chunk table is truncated (chunk {index})")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise TableError(f"a number in chunk {index} is too long")


def _unzig(value: int) -> int:
    return value >> 1 if not value & 1 else -((value + 1) >> 1)


def decode(text: object, *, packs: Sequence[str], max_size: int, max_offset: int
           ) -> list[ChunkRef]:
    """The chunks of a table whose pack indexes point into ``packs`` (the manifest's list);
    raises :class:`TableError` for anything malformed or out of range."""
    if not isinstance(text, str):
        raise TableError("the chunk table is not text")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise TableError("the chunk table is not base64") from None
    names = list(packs)
    count = len(names)
    # One hex string for the whole table, sliced per digest: a fraction of what a bytes slice
    # and its own .hex() cost per chunk.
    hexed = data.hex()
    refs: list[ChunkRef] = []
    # A named tuple's own constructor is Python code that fills in defaults: six times the
    # cost of tuple.__new__ with every field given, per chunk.
    make = tuple.__new__
    cursors = [0] * count
    pos = 0
    end = len(data)
    size = -1
    index = 0
    # Hot loop (a 2 GiB image has 65k chunks): one-byte numbers are read inline.
    while pos < end:
        flags = data[pos]
        if flags & ~_KNOWN_FLAGS:
            raise TableError(f"chunk {index} has unknown flags {flags:#x}")
        start = pos + 1
        pos = start + DIGEST_BYTES
        if pos > end:
            raise TableError(f"the chunk table is truncated (chunk {index})")
        digest = hexed[2 * start:2 * pos]
        if flags & FLAG_SAME_SIZE:
            if size < 0:
                raise TableError("the first chunk has no size")
        else:
            size, pos = _varint(data, pos, index)
            if size > max_size:
                raise TableError(f"chunk {index} has size {size} out of range")
        if pos < end and data[pos] < 0x80:
            pack = data[pos]
            pos += 1
        else:
            pack, pos = _varint(data, pos, index)
        if pack >= count:
            raise TableError(f"chunk {index} names pack {pack} of {count}")
        if pos < end and data[pos] < 0x80:
            rel = data[pos]
            pos += 1
        else:
            rel, pos = _varint(data, pos, index)
        offset = cursors[pack] + _unzig(rel)
        if not 0 <= offset <= max_offset:
            raise TableError(f"chunk {index} has offset {offset} out of range")
        if flags & FLAG_DELTA:
            if size % DELTA_PAGE or not 0 < size <= MAX_DELTA_PAGES * DELTA_PAGE:
                raise TableError(f"delta chunk {index} has size {size}, not a whole number "
                                 f"of {DELTA_PAGE}-byte pages up to {MAX_DELTA_PAGES}")
            # The mask comes last in the record but sizes this chunk's own extent, which the
            # base's offset is relative to when both lie in one pack: read ahead for it.
            base, pos = _varint(data, pos, index)
            if base >= count:
                raise TableError(f"chunk {index} names pack {base} of {count}")
            base_rel, pos = _varint(data, pos, index)
            mask, pos = _varint(data, pos, index)
            if not 0 < mask < 1 << (size // DELTA_PAGE):
                raise TableError(f"delta chunk {index} has a bad page mask {mask:#x}")
            cursors[pack] = offset + mask.bit_count() * DELTA_PAGE
            base_offset = cursors[base] + _unzig(base_rel)
            if not 0 <= base_offset <= max_offset:
                raise TableError(f"chunk {index} has base offset {base_offset} out of range")
            cursors[base] = base_offset + size
            refs.append(make(ChunkRef, (digest, size, names[pack], offset, names[base],
                                        base_offset, mask)))
        else:
            cursors[pack] = offset + size
            refs.append(make(ChunkRef, (digest, size, names[pack], offset, None, 0, 0)))
        index += 1
    return refs
