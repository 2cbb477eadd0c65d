"""The process ``steady_bench.py`` runs with and without snapshots: SIZE bytes held, a fixed
number of CPU-bound steps, a share of the pages rewritten as it goes.

    python steady_workload.py --bytes N --steps S --pages-per-step P [--threads T] --result FILE

It maps ``N`` bytes of private anonymous memory and fills them with random bytes (nothing
dedups). Then ``S`` steps, each: a SHA-256 of one MiB of the buffer (the step's compute: the
next MiB each step, round the buffer) and ``P`` pages overwritten with fresh random bytes (at
a stride that visits every page before any twice, so the pages written between two snapshots
are distinct). ``P`` is fractional: step ``i`` writes ``floor((i + 1) * P) - floor(i * P)``.
With ``--threads T`` the steps are dealt out to ``T`` threads (step ``i`` to thread ``i mod
T``), each writing pages of its own ``1/T`` of the buffer; the hashes release the GIL, so the
threads keep ``T`` cores busy.

When the last step is done it writes ``FILE`` (by a rename): one JSON object with the seconds
the steps took (``CLOCK_MONOTONIC``, which a dump that leaves it running does not stop), the
CPU seconds the process used in them and in all, and the pages written. Nothing else is timed: start-up
and the fill are the same with and without snapshots.

Its stdin, stdout and stderr are what it is given; it writes nothing to them unless it fails.
No sockets, no terminal: CRIU dumps it with no extra options.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import mmap
import os
import resource
import threading
import time

PAGE = mmap.PAGESIZE
MIB = 1 << 20
# Pages are rewritten from a pool of random bytes refreshed now and then: os.urandom per page
# would make the step's cost the kernel's RNG, not memory.
POOL_PAGES = 256


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def coprime_stride(pages: int) -> int:
    """A stride coprime with ``pages``: stepping by it visits every page once per round."""
    if pages <= 2:
        return 1
    return next(s for s in range(pages // 2 + 1, pages) if math.gcd(s, pages) == 1)


def run_steps(buf: mmap.mmap, view: memoryview, steps: range, pages_per_step: float,
              first_page: int, region_pages: int) -> int:
    """The steps of one thread; it writes pages of its own region only. Returns the pages
    written."""
    size = len(buf)
    pool = os.urandom(POOL_PAGES * PAGE)
    stride = coprime_stride(region_pages)
    written = offset = 0
    for step in steps:
        at = (step * MIB) % size
        hashlib.sha256(view[at:at + MIB]).digest()  # releases the GIL: threads hash at once
        due = math.floor((step + 1) * pages_per_step) - math.floor(step * pages_per_step)
        for _ in range(due):
            src = (written % POOL_PAGES) * PAGE
            page = first_page + offset
            buf[page * PAGE:(page + 1) * PAGE] = pool[src:src + PAGE]
            offset = (offset + stride) % region_pages
            written += 1
            if written % POOL_PAGES == 0:
                pool = os.urandom(POOL_PAGES * PAGE)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--pages-per-step", type=float, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    size = max(MIB, args.bytes - args.bytes % MIB)
    pages = size // PAGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, size, MIB):  # small pieces: a large temporary would stay in the heap
        buf[offset:offset + MIB] = os.urandom(MIB)
    view = memoryview(buf)
    threads = max(1, args.threads)
    region = pages // threads
    written = [0] * threads

    def worker(k: int) -> None:
        written[k] = run_steps(buf, view, range(k, args.steps, threads), args.pages_per_step,
                               k * region, region)

    start, cpu_start = time.monotonic(), cpu_s()
    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    elapsed, cpu = time.monotonic() - start, cpu_s() - cpu_start
    view.release()
    tmp = args.result + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        json.dump({"steps_s": elapsed, "cpu_s": cpu, "cpu_total_s": cpu_s(),
                   "pages_written": sum(written), "pages": pages, "threads": threads}, f)
    os.rename(tmp, args.result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
