"""The process that ``user_path_bench.py`` kills and restores: SIZE bytes held, a step every
~0.2 s, a digest of the whole buffer on request.

    python user_path_workload.py --bytes N --memory random|repeated --dir DIR

It maps ``N`` bytes of private anonymous memory and fills them once: ``random`` with
:func:`os.urandom` (nothing dedups or compresses), ``repeated`` with one MiB of random bytes
over and over (a store that dedups keeps one MiB). The buffer is never written again, so the
digest taken before a kill is the digest a faithful restore must give, whatever step the
snapshot caught.

A step reads one byte of a page (a different page each step), appends the step number to
``DIR/progress`` (opened, appended and closed each step: no descriptor the bench must keep
track of, and a restored process writes to the same path) and sleeps ``STEP_S``. The bench
times a restore until this file grows.

On SIGUSR1 it writes ``DIR/digest`` (BLAKE3 of the buffer when the ``blake3`` package is there,
else BLAKE2b; the name is written with it), by a rename, so the bench never reads half of it.

Its stdin, stdout and stderr are what it is given; it writes nothing to them unless it fails.
No threads, no sockets, no terminal: CRIU dumps and restores it with no extra options.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import signal
import time

try:
    import blake3
except ImportError:  # pragma: no cover - cairn depends on blake3; keep the workload standalone
    blake3 = None

STEP_S = 0.2
PIECE = 1 << 20  # the fill's unit, and the repeated pattern's length
DIGEST_PIECE = 16 << 20  # the digest reads views of this size (no copies)


def fill(buf: mmap.mmap, memory: str) -> None:
    # Small pieces copied in: one large temporary would stay in the heap, be dumped with the
    # buffer and double the image.
    pattern = os.urandom(PIECE)
    for offset in range(0, len(buf), PIECE):
        n = min(PIECE, len(buf) - offset)
        buf[offset:offset + n] = (os.urandom(n) if memory == "random" else pattern[:n])


def digest(buf: mmap.mmap) -> str:
    h = blake3.blake3() if blake3 is not None else hashlib.blake2b()
    view = memoryview(buf)
    try:
        for offset in range(0, len(buf), DIGEST_PIECE):
            h.update(view[offset:offset + DIGEST_PIECE])
    finally:
        view.release()
    return f"{'blake3' if blake3 is not None else 'blake2b'}:{h.hexdigest()}"


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(text)
    os.rename(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--memory", choices=("random", "repeated"), required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    size = max(mmap.PAGESIZE, args.bytes - args.bytes % mmap.PAGESIZE)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fill(buf, args.memory)
    progress = os.path.join(args.dir, "progress")
    wanted = [False]

    def on_usr1(signum: int, frame: object) -> None:
        # Only a flag: the digest runs between steps, never inside one.
        wanted[0] = True

    signal.signal(signal.SIGUSR1, on_usr1)
    write_atomic(os.path.join(args.dir, "pid"), f"{os.getpid()}\n")
    step = 0
    pages = size // mmap.PAGESIZE
    while True:
        step += 1
        _ = buf[(step * 7919 % pages) * mmap.PAGESIZE]  # read one page: a step touches memory
        with open(progress, "a", encoding="ascii") as f:
            f.write(f"{step}\n")
        if wanted[0]:
            wanted[0] = False
            write_atomic(os.path.join(args.dir, "digest"), digest(buf) + "\n")
        time.sleep(STEP_S)


if __name__ == "__main__":
    raise SystemExit(main())
