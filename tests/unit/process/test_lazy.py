"""The lazy restore's page index and page source against a real local store (the handler in
``test_lazy_handler.py``; the whole restore under CRIU in
``tests/integration/process/test_lazy_restore.py``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.process import images as I
from cairn.process import lazy
from cairn.store import Key, SnapshotMode
from cairn import open_store
from tests.support.fake_dump import field, image
from tests.support.tamper import flip_byte

PAGE = I.PAGE_SIZE
PID = 4242
# (vaddr, pages, flags): an eager run (a stack), a lazy run, a run in the parent (not in the
# pages image), and a lazy run right after the first lazy one in address space.
RUNS = [(0x7FFF0000, 2, I.PE_PRESENT),
        (0x10000000, 20, I.PE_PRESENT | I.PE_LAZY),
        (0x20000000, 4, I.PE_PARENT),
        (0x10014000, 12, I.PE_PRESENT | I.PE_LAZY)]
PRESENT_PAGES = 2 + 20 + 12


def snapshot_with_pages(tmp_path: Path):  # noqa: ANN201 - (store, manifest, pages)
    images = tmp_path / "dump"
    images.mkdir()
    image(images / f"pagemap-{PID}.img", I.PAGEMAP_MAGIC,
          [field(1, 1)] + [field(1, v) + field(2, n) + field(4, f) for v, n, f in RUNS])
    pages = os.urandom(PRESENT_PAGES * PAGE)
    (images / "pages-1.img").write_bytes(pages)
    store = open_store(str(tmp_path / "store"))
    attempt = store.open_attempt(Key.parse("t/lazy/1"))
    cuts = I.pages_layout_by_file(images)["pages-1.img"][0]
    with attempt.snapshot(mode=SnapshotMode.PROCESS) as snap:
        snap.add_file(f"images/pagemap-{PID}.img", images / f"pagemap-{PID}.img")
        snap.add_file("images/pages-1.img", images / "pages-1.img", cuts=cuts)
        manifest = snap.commit(compat={}, user={"process": {}})
    scratch = tmp_path / "scratch"
    store.reader(manifest).restore_to(scratch, durable=False, exclude=["images/pages-1.img"])
    return store, manifest, pages, str(scratch / "images")


def test_the_index_maps_addresses_to_the_pages_image(tmp_path: Path) -> None:
    store, _, _, image_dir = snapshot_with_pages(tmp_path)
    index = lazy.PageIndex(image_dir)
    assert index.pids() == [PID]
    assert index.eager_ranges() == [("pages-1.img", 0, 2 * PAGE)]
    # The two lazy runs are adjacent in address space but not in the file (pagemap order).
    assert index.locate(PID, 0x10000000 + 3 * PAGE, PAGE) == [("pages-1.img", 5 * PAGE, PAGE)]
    assert index.locate(PID, 0x10000000 + 19 * PAGE, 2 * PAGE) == [
        ("pages-1.img", 21 * PAGE, PAGE), ("pages-1.img", 22 * PAGE, PAGE)]
    with pytest.raises(CorruptSnapshot, match="no pagemap entry holds"):
        index.locate(PID, 0x20000000, PAGE)  # in the parent, not in this image
    with pytest.raises(CorruptSnapshot, match="does not hold"):
        index.locate(PID + 1, 0x10000000, PAGE)
    store.close()


def test_the_source_serves_verified_bytes_while_three_threads_fill(tmp_path: Path) -> None:
    store, manifest, pages, image_dir = snapshot_with_pages(tmp_path)
    source = lazy.PageSource(store.reader(manifest), manifest, image_dir, ["pages-1.img"])
    assert source.read("pages-1.img", 7 * PAGE, 3 * PAGE) == pages[7 * PAGE:10 * PAGE]
    threads = [threading.Thread(target=lambda: [None for _ in iter(source.fill_next, False)])
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert source.complete
    assert source.bytes_fetched == len(pages), "every chunk fetched exactly once"
    assert Path(image_dir, "pages-1.img").read_bytes() == pages
    source.close()
    store.close()


def test_a_corrupt_chunk_is_reported_to_every_reader_and_never_written(tmp_path: Path) -> None:
    store, manifest, _, image_dir = snapshot_with_pages(tmp_path)
    chunk = next(c for c in manifest.file("images/pages-1.img").chunks)
    flip_byte(store.backend, chunk.pack, chunk.offset)
    source = lazy.PageSource(store.reader(manifest), manifest, image_dir, ["pages-1.img"])
    with pytest.raises(CorruptSnapshot, match="does not match its digest"):
        source.ensure("pages-1.img", 0, PAGE, urgent=True)
    with pytest.raises(CorruptSnapshot):
        source.read("pages-1.img", 0, PAGE)  # every later reader sees the failure too
    with pytest.raises(CorruptSnapshot):
        source.fill_next(yield_to_faults=True)
    assert source.ready_prefix("pages-1.img", 0, PAGE) == 0
    assert Path(image_dir, "pages-1.img").read_bytes()[:chunk.size] == bytes(chunk.size)
    source.close()
    store.close()


def test_ready_prefix_counts_verified_bytes_from_an_offset(tmp_path: Path) -> None:
    store, manifest, pages, image_dir = snapshot_with_pages(tmp_path)
    source = lazy.PageSource(store.reader(manifest), manifest, image_dir, ["pages-1.img"])
    assert source.ready_prefix("pages-1.img", 0, len(pages)) == 0
    source.ensure("pages-1.img", 0, PAGE)
    first = manifest.file("images/pages-1.img").chunks[0].size
    assert source.ready_prefix("pages-1.img", 0, len(pages)) == first
    assert source.ready_prefix("pages-1.img", PAGE, len(pages)) == first - PAGE
    assert not source.exhausted
    while source.fill_next():
        pass
    assert source.exhausted and source.ready_prefix("pages-1.img", 0, len(pages)) == len(pages)
    source.close()
    store.close()


def test_restore_modes_parse_with_the_choices_named() -> None:
    from cairn.exceptions import ConfigError
    from cairn.process.restore import RestoreMode

    assert RestoreMode.parse("lazy") is RestoreMode.LAZY
    assert RestoreMode.parse(RestoreMode.EAGER) is RestoreMode.EAGER
    with pytest.raises(ConfigError, match="--restore 'fast' is not one of 'eager', 'lazy'"):
        RestoreMode.parse("fast")
