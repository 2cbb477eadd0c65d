"""A directory shaped like CRIU's images, written byte by byte, for tests that run without
CRIU (the spool and the uploader: they read only ``stats-dump``, ``files.img`` and page
images). Not a restorable dump; the integration tests use real ones."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from cairn.process import images as I


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, bytes):
        return _varint(number << 3 | 2) + _varint(len(value)) + value
    return _varint(number << 3) + _varint(value)


def _image(path: Path, magic: int, messages: list[bytes]) -> None:
    body = b"".join(struct.pack("<I", len(m)) + m for m in messages)
    path.write_bytes(struct.pack("<II", I.IMG_COMMON_MAGIC, magic) + body)


def fake_dump(image_dir: str | os.PathLike[str], *, appended: dict[str, int] | None = None,
              pages: bytes | None = None, frozen_us: int = 1234) -> Path:
    """Write ``stats-dump``, ``files.img`` (each of ``appended``: a file open for append at
    that position, as CRIU records a log), ``pages-1.img`` and a ``dump.log``."""
    d = Path(image_dir)
    d.mkdir(parents=True, exist_ok=True)
    stats = b"".join(_field(n, v) for n, v in [(1, 5), (2, frozen_us), (3, 7), (4, 8),
                                               (5, 100), (6, 0), (7, 90), (9, 0)])
    _image(d / "stats-dump", I.STATS_MAGIC, [_field(1, stats)])
    messages = []
    for index, (path, pos) in enumerate(sorted((appended or {}).items()), start=3):
        reg = _field(1, index) + _field(2, 0o102001) + _field(3, pos) + _field(6, path.encode())
        messages.append(_field(1, 1) + _field(2, index) + _field(3, reg))
    _image(d / "files.img", I.FILES_MAGIC, messages)
    (d / "pages-1.img").write_bytes(pages if pages is not None else os.urandom(3 * I.PAGE_SIZE))
    (d / "dump.log").write_text("(00.000001) Dumping finished successfully\n")
    return d
