"""cairn's userfaultfd handler against the real kernel, without CRIU: the test plays
``criu restore --lazy-pages`` (it registers a region of its own memory with a real
userfaultfd and hands the descriptor over ``lazy-pages.socket``, then sends the restore's
end), and reads the region from a thread, which faults. The pages come from a snapshot in a
real local store. The whole tree under CRIU is driven in
``tests/integration/process/test_lazy_restore.py``."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.process import images as I
from cairn.process import lazy, uffd
from cairn.process.lazy_handler import FaultHandler, Pending
from cairn.store import Key, SnapshotMode
from cairn import open_store
from tests.support.fake_dump import field, image
from tests.support.tamper import flip_byte

PAGE = I.PAGE_SIZE
PID = 4242
PAGES = 1024  # 4 MiB: two fault-around windows and more than one background step
SIZE = PAGES * PAGE
SYS_USERFAULTFD = 323  # x86_64
FEATURES = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6)  # EVENT_FORK, REMAP, REMOVE, UNMAP
UFFDIO_API = (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F
UFFDIO_REGISTER = (3 << 30) | (32 << 16) | (0xAA << 8) | 0x00
MADV_DONTNEED = 4
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                        ctypes.c_void_p]
libc.syscall.restype = ctypes.c_long


def open_uffd() -> int:
    fd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        pytest.skip(f"no userfaultfd here: {os.strerror(ctypes.get_errno())}")
    arg = bytearray(struct.pack("<QQQ", 0xAA, FEATURES, 0))
    fcntl.ioctl(fd, UFFDIO_API, arg, True)
    return int(fd)


def anon(size: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE) -> int:
    address = libc.mmap(None, size, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value)
    return int(address)


def read_memory(address: int, length: int, out: Path) -> threading.Thread:
    """Copy memory into ``out`` on a thread; ``write`` reads the buffer in the kernel with
    the GIL released, so the handler's thread runs while this one waits on a fault."""
    def copy() -> None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
            pos = 0
            while pos < length:
                pos += os.write(fd, view[pos:])
        finally:
            os.close(fd)
    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


class Restore:
    """A region of this process as CRIU would leave a lazily restored one, its snapshot in a
    local store, and the handler serving it."""

    def __init__(self, tmp_path: Path, *, corrupt: bool = False) -> None:
        self.tmp = tmp_path
        self.region = anon(SIZE)
        self.pages = os.urandom(SIZE)
        dump = tmp_path / "dump"
        dump.mkdir()
        image(dump / f"pagemap-{PID}.img", I.PAGEMAP_MAGIC,
              [field(1, 1), field(1, self.region) + field(2, PAGES)
               + field(4, I.PE_PRESENT | I.PE_LAZY)])
        # Two VMAs as dumped (the kernel may have merged them): a copy stays inside one.
        half = self.region + SIZE // 2
        vmas = [field(1, self.region) + field(2, half), field(1, half) + field(2, self.region + SIZE)]
        image(dump / f"mm-{PID}.img", lazy.MM_MAGIC, [b"".join(field(14, v) for v in vmas)])
        (dump / "pages-1.img").write_bytes(self.pages)
        self.store = open_store(str(tmp_path / "store"))
        attempt = self.store.open_attempt(Key.parse("t/uffd/1"))
        cuts = I.pages_layout_by_file(dump)["pages-1.img"][0]
        with attempt.snapshot(mode=SnapshotMode.PROCESS) as snap:
            for name in (f"pagemap-{PID}.img", f"mm-{PID}.img"):
                snap.add_file(f"images/{name}", dump / name)
            snap.add_file("images/pages-1.img", dump / "pages-1.img", cuts=cuts)
            manifest = snap.commit(compat={}, user={"process": {}})
        self.chunks = manifest.file("images/pages-1.img").chunks
        if corrupt:  # a chunk in the second window
            chunk = self.chunks[len(self.chunks) * 3 // 4]
            flip_byte(self.store.backend, chunk.pack, chunk.offset)
            self.bad = sum(c.size for c in self.chunks[:len(self.chunks) * 3 // 4])
            self.bad_size = chunk.size
        scratch = tmp_path / "scratch"
        self.store.reader(manifest).restore_to(scratch, durable=False,
                                               exclude=["images/pages-1.img"])
        image_dir = str(scratch / "images")
        self.index = lazy.PageIndex(image_dir)
        self.source = lazy.PageSource(self.store.reader(manifest), manifest, image_dir,
                                      ["pages-1.img"])
        self.failures: list[BaseException] = []
        self.filler: threading.Thread | None = None
        self.handler = FaultHandler(uffd.HandoverListener(image_dir),
                                    plan=self.index.lazy_segments, locate=self.index.locate,
                                    source=self.source, on_failure=self.failures.append)
        self.source.on_progress = self.handler.wake
        self.thread = threading.Thread(target=self.handler.run, daemon=True)
        self.thread.start()
        # What the restorer does: a userfaultfd on the lazy range, handed over, then closed.
        fd = open_uffd()
        fcntl.ioctl(fd, UFFDIO_REGISTER, bytearray(struct.pack("<QQQQ", self.region, SIZE, 1, 0)),
                    True)
        self.criu = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.criu.connect(os.path.join(image_dir, uffd.SOCKET_NAME))
        self.criu.sendall(struct.pack("<i", -(PID + 1)))  # a zombie sends its pid only
        self.criu.sendall(struct.pack("<i", PID))
        socket.send_fds(self.criu, [b"\0"], [fd])
        os.close(fd)

    def finish(self) -> None:
        """The end of the restore: the background fetch starts (as LazyRestore starts it),
        and the background copies may start."""
        self.criu.sendall(struct.pack("<I", uffd.RESTORE_FINISHED))
        self.criu.close()

        def fill() -> None:
            with contextlib.suppress(CorruptSnapshot):
                while self.source.fill_next():
                    pass
            self.handler.wake()
        self.filler = threading.Thread(target=fill, daemon=True)
        self.filler.start()

    def read(self, offset: int, length: int, name: str) -> bytes:
        out = self.tmp / name
        thread = read_memory(self.region + offset, length, out)
        thread.join(timeout=120)
        assert not thread.is_alive(), "the read never got its pages"
        return out.read_bytes()

    def close(self) -> None:
        self.handler.stop()
        self.thread.join(timeout=60)
        if self.filler is not None:
            self.filler.join(timeout=60)
        self.source.close()
        self.store.close()
        libc.munmap(self.region, SIZE)


@pytest.fixture
def restore(tmp_path: Path) -> Iterator[Restore]:
    r = Restore(tmp_path)
    yield r
    r.close()


def test_faults_and_the_background_put_back_every_page_bit_identical(restore: Restore) -> None:
    middle = SIZE // 2 - PAGE  # one page before the VMA bound, one after
    assert restore.read(middle, 2 * PAGE, "fault") == restore.pages[middle:middle + 2 * PAGE]
    faults = restore.handler.stats.faults
    assert faults >= 1 and restore.handler.stats.background_bytes == 0, \
        "nothing is copied in the background before the restore has finished"
    restore.finish()
    assert restore.handler.done.wait(120) and restore.handler.complete
    assert restore.failures == []
    assert restore.read(0, SIZE, "all") == restore.pages
    st = restore.handler.stats
    assert st.fault_bytes + st.background_bytes == SIZE, "every page copied exactly once"
    assert restore.handler.pids == [PID]


def test_a_removed_range_reads_zeros_and_is_not_filled_again(restore: Restore) -> None:
    start, length = 100 * PAGE, 50 * PAGE
    assert libc.madvise(restore.region + start, length, MADV_DONTNEED) == 0
    restore.finish()
    assert restore.handler.done.wait(120) and restore.handler.complete
    got = restore.read(0, SIZE, "all")
    assert got[start:start + length] == bytes(length), "MADV_DONTNEED means zeros"
    assert got[:start] == restore.pages[:start]
    assert got[start + length:] == restore.pages[start + length:]
    assert restore.handler.stats.removes == 1


def test_a_remapped_range_gets_its_pages_where_it_went(restore: Restore) -> None:
    start, length = 300 * PAGE, 64 * PAGE
    target = anon(length, 0)  # PROT_NONE: a place to move to
    moved = libc.mremap(restore.region + start, length, length, MREMAP_MAYMOVE | MREMAP_FIXED,
                        target)
    assert moved == target
    restore.finish()
    assert restore.handler.done.wait(120) and restore.handler.complete
    out = restore.tmp / "moved"
    thread = read_memory(target, length, out)
    thread.join(timeout=120)
    assert out.read_bytes() == restore.pages[start:start + length]
    assert restore.read(0, start, "head") == restore.pages[:start]
    assert restore.handler.stats.remaps == 1
    libc.munmap(target, length)


def test_an_unmapped_range_is_dropped(restore: Restore) -> None:
    assert libc.munmap(restore.region + SIZE - 16 * PAGE, 16 * PAGE) == 0
    restore.finish()
    assert restore.handler.done.wait(120) and restore.handler.complete
    assert restore.read(0, SIZE - 16 * PAGE, "rest") == restore.pages[:SIZE - 16 * PAGE]


def test_a_chunk_that_fails_verification_is_never_copied(tmp_path: Path) -> None:
    r = Restore(tmp_path, corrupt=True)
    try:
        out = tmp_path / "bad"
        thread = read_memory(r.region + r.bad, r.bad_size, out)
        for _ in range(1200):
            if r.failures:
                break
            thread.join(timeout=0.1)
        assert len(r.failures) == 1 and isinstance(r.failures[0], CorruptSnapshot), r.failures
        assert "does not match its digest" in str(r.failures[0])
        assert thread.is_alive(), "the faulting thread waits until the tree would be killed"
        assert not r.handler.done.is_set(), "the userfaultfd stays open until stop()"
        r.handler.stop()  # what LazyRestore.fail does once the tree is dead
        thread.join(timeout=120)
        assert not thread.is_alive()
        # Closing the descriptor let the kernel map zero pages: no byte of the bad chunk.
        assert out.read_bytes() == bytes(r.bad_size)
    finally:
        r.close()


def test_pending_ranges_split_move_and_come_back() -> None:
    p = Pending([(0x1000, 0x5000, 0x1000), (0x8000, 0x9000, 0x8000)])
    assert p.take(0x2000, 0x8800) == [(0x2000, 0x5000, 0x2000), (0x8000, 0x8800, 0x8000)]
    assert list(p) == [(0x1000, 0x2000, 0x1000), (0x8800, 0x9000, 0x8800)]
    p.remap(0x8800, 0x20000, 0x800)
    assert list(p) == [(0x1000, 0x2000, 0x1000), (0x20000, 0x20800, 0x8800)]
    assert p.find(0x20400) == (0x20000, 0x20800, 0x8800) and p.find(0x8800) is None
    p.put([(0x3000, 0x4000, 0x3000)])
    assert p.first() == (0x1000, 0x2000, 0x1000) and p.bytes == 0x1000 + 0x1000 + 0x800
    child = p.copy()
    child.take(0, 1 << 40)
    assert not child and p.bytes == 0x2800


def test_lazy_segments_are_cut_at_the_dumped_vma_bounds(restore: Restore) -> None:
    half = restore.region + SIZE // 2
    assert list(restore.index.lazy_segments(PID)) == [
        (restore.region, half, restore.region), (half, restore.region + SIZE, half)]
    assert not restore.index.lazy_segments(PID + 1)
    restore.finish()


def test_a_restore_that_hangs_up_before_finishing_is_a_failure(restore: Restore) -> None:
    restore.criu.close()  # CRIU died mid-restore: no LAZY_PAGES_RESTORE_FINISHED
    for _ in range(600):
        if restore.failures:
            break
        restore.handler.done.wait(0.1)
    assert len(restore.failures) == 1 and "before the restore finished" in \
        str(restore.failures[0]), restore.failures
    assert not restore.handler.done.is_set(), "the userfaultfd stays open until stop()"
    assert restore.handler.stats.background_bytes == 0
