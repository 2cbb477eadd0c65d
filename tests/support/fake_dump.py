"""A directory shaped like CRIU's images, written byte by byte, for tests that run without
CRIU (the spool and the uploader: they read only ``stats-dump``, ``files.img`` and page
images). Not a restorable dump; the integration tests use real ones. ``varint``, ``field``
and ``image`` write CRIU's protobuf-in-image wire format for other tests too."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from cairn.process import images as I


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, bytes):
        return varint(number << 3 | 2) + varint(len(value)) + value
    return varint(number << 3) + varint(value)


def image(path: Path, magic: int, messages: list[bytes]) -> None:
    body = b"".join(struct.pack("<I", len(m)) + m for m in messages)
    path.write_bytes(struct.pack("<II", I.IMG_COMMON_MAGIC, magic) + body)


def fake_dump(image_dir: str | os.PathLike[str], *, appended: dict[str, int] | None = None,
              pages: bytes | None = None, frozen_us: int = 1234,
              pages_at: int | None = None) -> Path:
    """Write ``stats-dump``, ``files.img`` (each of ``appended``: a file open for append at
    that position, as CRIU records a log), ``pages-1.img`` and a ``dump.log``; with
    ``pages_at``, also ``pagemap-1.img`` placing every page at that virtual address on."""
    d = Path(image_dir)
    d.mkdir(parents=True, exist_ok=True)
    stats = b"".join(field(n, v) for n, v in [(1, 5), (2, frozen_us), (3, 7), (4, 8),
                                               (5, 100), (6, 0), (7, 90), (9, 0)])
    image(d / "stats-dump", I.STATS_MAGIC, [field(1, stats)])
    messages = []
    for index, (path, pos) in enumerate(sorted((appended or {}).items()), start=3):
        reg = field(1, index) + field(2, 0o102001) + field(3, pos) + field(6, path.encode())
        messages.append(field(1, 1) + field(2, index) + field(3, reg))
    image(d / "files.img", I.FILES_MAGIC, messages)
    data = pages if pages is not None else os.urandom(3 * I.PAGE_SIZE)
    (d / "pages-1.img").write_bytes(data)
    if pages_at is not None:
        entry = field(1, pages_at) + field(2, len(data) // I.PAGE_SIZE) + field(4, I.PE_PRESENT)
        image(d / "pagemap-1.img", I.PAGEMAP_MAGIC, [field(1, 1), entry])
    (d / "dump.log").write_text("(00.000001) Dumping finished successfully\n")
    return d
