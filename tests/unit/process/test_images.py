"""The CRIU image reader against images built here byte by byte (the wire format is simple
enough to write; real images are read in the integration tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.process import images as I
from tests.support.fake_dump import field, image


def test_pagemap_runs_and_cuts_follow_regions_and_addresses(tmp_path: Path) -> None:
    page = I.PAGE_SIZE
    runs = [(0x10000, 2, I.PE_PRESENT),  # 64K-aligned
            (0x7F0000001000, 20, I.PE_PRESENT | I.PE_LAZY),  # starts one page past a 32K line
            (0x90000, 3, I.PE_PARENT)]  # not in this image
    image(tmp_path / "pagemap-7.img", I.PAGEMAP_MAGIC,
           [field(1, 4)] + [field(1, v) + field(2, n) + field(4, f) for v, n, f in runs])
    pages_id, parsed = I.read_pagemap(tmp_path / "pagemap-7.img")
    assert pages_id == 4
    assert [(r.vaddr, r.nr_pages, r.present) for r in parsed] == [
        (0x10000, 2, True), (0x7F0000001000, 20, True), (0x90000, 3, False)]
    cuts = I.page_cuts(parsed, every=32 << 10)
    second = 2 * page
    # each present run starts a chunk; inside it, every 32 KiB address boundary does too
    assert cuts == [0, second, second + (32 << 10) - page, second + 2 * (32 << 10) - page]
    assert {name: c for name, (c, _) in I.pages_layout_by_file(tmp_path).items()} == {
        "pages-4.img": cuts}


def test_old_pagemap_without_flags_uses_in_parent(tmp_path: Path) -> None:
    image(tmp_path / "pagemap-1.img", I.PAGEMAP_MAGIC,
           [field(1, 1), field(1, 0x1000) + field(2, 1),
            field(1, 0x5000) + field(2, 1) + field(3, 1)])
    _, runs = I.read_pagemap(tmp_path / "pagemap-1.img")
    assert [r.present for r in runs] == [True, False]


def test_dump_stats_and_reg_files(tmp_path: Path) -> None:
    dump = b"".join(field(n, v) for n, v in [(1, 5), (2, 1234), (3, 7), (4, 8), (5, 100),
                                              (6, 0), (7, 90), (9, 0)])
    image(tmp_path / "stats-dump", I.STATS_MAGIC, [field(1, dump)])
    stats = I.read_dump_stats(tmp_path)
    assert (stats.frozen_us, stats.freezing_us, stats.pages_written) == (1234, 5, 90)

    reg_append = field(1, 3) + field(2, 0o102001) + field(3, 47) + field(6, b"/tmp/log")
    reg_sized = (field(1, 4) + field(2, 0o100001) + field(3, 10) + field(6, b"/tmp/out")
                 + field(8, 279))
    usk = field(1, 9) + field(2, 77) + field(11, b"/tmp/pymp-x/listener")
    abstract = field(1, 10) + field(11, b"\0abstract")
    image(tmp_path / "files.img", I.FILES_MAGIC,
           [field(1, 1) + field(2, 3) + field(3, reg_append),
            field(1, 1) + field(2, 4) + field(3, reg_sized),
            field(1, 5) + field(2, 9) + field(16, usk),
            field(1, 5) + field(2, 10) + field(16, abstract)])
    files = I.read_reg_files(tmp_path)
    assert [(f.name, f.pos, f.size) for f in files] == [("/tmp/log", 47, None),
                                                        ("/tmp/out", 10, 279)]
    assert I.read_unix_socket_paths(tmp_path) == ["/tmp/pymp-x/listener"]


def test_wrong_magic_and_truncation_are_refused(tmp_path: Path) -> None:
    image(tmp_path / "x.img", I.STATS_MAGIC, [b"\x08\x01"])
    with pytest.raises(I.ImageError, match="magic"):
        I.entries(tmp_path / "x.img", magic=I.PAGEMAP_MAGIC)
    data = (tmp_path / "x.img").read_bytes()
    (tmp_path / "y.img").write_bytes(data[:-1])
    with pytest.raises(I.ImageError, match="truncated"):
        I.entries(tmp_path / "y.img", magic=I.STATS_MAGIC)
    with pytest.raises(I.ImageError):
        list(I.fields(b"\x0b"))  # wire type 3 (groups) is not used by CRIU
