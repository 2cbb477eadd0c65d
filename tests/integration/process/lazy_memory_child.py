"""A workload for lazy restores: MIB MiB of seeded bytes in private anonymous memory, and
numbered steps appended to a metrics file (one ``write`` each, ``O_APPEND``).

Each step checks 4 pages picked at random against the seed. The first step that finds part of
the buffer not resident (``mincore``: what a lazy restore leaves until the pages are copied
in) also, in that lazy phase: forks a child that checks 64 pages and exits 0 (3 if one is
wrong), releases 16 pages with ``MADV_DONTNEED`` and expects zeros there before writing them
back, and grows a second, 8 MiB map (``mremap``, which may move it) whose old bytes must move
with it. It reports that in ``REPORT`` (``lazy phase: ...``). The last step checks every
page and reports ``every page verified``. Exit 3 on the first wrong byte.

    python lazy_memory_child.py METRICS REPORT STEPS PAUSE MIB
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import random
import sys
import time

PAGE = mmap.PAGESIZE
BLOCK = 1 << 20
MOVING = 8 << 20
MADV_DONTNEED = 4

libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def block(seed: str, index: int) -> bytes:
    return hashlib.shake_128(f"{seed}-{index}".encode()).digest(BLOCK)


def expected_page(seed: str, page: int) -> bytes:
    start = page * PAGE % BLOCK
    return block(seed, page * PAGE // BLOCK)[start:start + PAGE]


def fill(size: int, seed: str) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(size // BLOCK):
        buf[i * BLOCK:(i + 1) * BLOCK] = block(seed, i)
    return buf


def fail(report: str, text: str) -> None:
    with open(report, "a") as f:
        f.write(f"WRONG: {text}\n")
    sys.exit(3)


def check_pages(buf: mmap.mmap, seed: str, pages: list[int]) -> int | None:
    for page in pages:
        if buf[page * PAGE:(page + 1) * PAGE] != expected_page(seed, page):
            return page
    return None


def check_every_page(buf: mmap.mmap, seed: str) -> int | None:
    """The first wrong page of the whole buffer, None when every page is right. Compared a
    block at a time: each block's bytes are derived once, not once per page (256 times)."""
    per_block = BLOCK // PAGE
    for index in range(len(buf) // BLOCK):
        if buf[index * BLOCK:(index + 1) * BLOCK] != block(seed, index):
            return check_pages(buf, seed, list(range(index * per_block, (index + 1) * per_block)))
    return None


def missing_pages(address: int, size: int) -> int:
    vec = ctypes.create_string_buffer(size // PAGE)
    if libc.mincore(address, size, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(1 for b in vec.raw if not b & 1)


def lazy_phase(buf: mmap.mmap, address: int, moving: mmap.mmap, report: str) -> None:
    pages = len(buf) // PAGE
    rng = random.Random(7)
    sample = rng.sample(range(pages), 64)
    child = os.fork()
    if child == 0:
        os._exit(3 if check_pages(buf, "main", sample) is not None else 0)
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        fail(report, "the child forked in the lazy phase read a wrong page")
    first = rng.randrange(0, pages - 16)
    if libc.madvise(address + first * PAGE, 16 * PAGE, MADV_DONTNEED) != 0:
        fail(report, f"madvise: {os.strerror(ctypes.get_errno())}")
    if buf[first * PAGE:(first + 16) * PAGE] != bytes(16 * PAGE):
        fail(report, "pages released with MADV_DONTNEED did not read zeros")
    for page in range(first, first + 16):
        buf[page * PAGE:(page + 1) * PAGE] = expected_page("main", page)
    moving.resize(2 * MOVING)
    if moving[:MOVING] != b"".join(block("moving", i) for i in range(MOVING // BLOCK)) or \
            moving[MOVING:] != bytes(MOVING):
        fail(report, "a map grown (and maybe moved) by mremap lost its bytes")
    with open(report, "a") as f:
        f.write(f"lazy phase: fork, madvise and mremap checked with "
                f"{missing_pages(address, len(buf))} pages still missing\n")


def main() -> None:
    metrics, report, steps, pause, mib = sys.argv[1:6]
    size = int(mib) << 20
    buf = fill(size, "main")
    moving = fill(MOVING, "moving")
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    pages = size // PAGE
    rng = random.Random()
    fd = os.open(metrics, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    done_lazy = False
    for step in range(int(steps)):
        if not done_lazy and missing_pages(address, size):
            lazy_phase(buf, address, moving, report)
            done_lazy = True
        wrong = check_pages(buf, "main", [rng.randrange(pages) for _ in range(4)])
        if wrong is not None:
            fail(report, f"page {wrong} at step {step}")
        os.write(fd, f"{step}\n".encode())
        time.sleep(float(pause))
    wrong = check_every_page(buf, "main")
    if wrong is not None:
        fail(report, f"page {wrong} at the end")
    if moving[:MOVING] != b"".join(block("moving", i) for i in range(MOVING // BLOCK)):
        fail(report, "the second map at the end")
    with open(report, "a") as f:
        f.write("every page verified\n")


if __name__ == "__main__":
    main()
