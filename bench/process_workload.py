"""The process that ``process_bench.py`` snapshots: N bytes of random data in memory, changed
on command.

    python process_workload.py --bytes N --dir DIR [--seed S]

It maps ``N`` bytes of private anonymous memory (what a training process's heap is), fills
them with pseudo-random bytes (BLAKE3 in extendable-output mode when the ``blake3`` package is
there, else :func:`os.urandom`: nothing in it dedups), then serves commands through two files
in ``DIR``, both replaced by ``rename`` and never held open (so a dump never catches a
descriptor on them, and a restored process finds them by path):

* ``DIR/ctl`` (written by the bench): ``SEQ COMMAND [ARGS]``. The workload ``stat``-s it every
  ``POLL_S`` and reads it only when its inode or mtime changed, then runs a command whose
  ``SEQ`` is above the last one it ran;
* ``DIR/ack`` (written by the workload): ``SEQ RESULT``. ``SEQ`` 0 means "ready".

Commands:

* ``contig FRACTION RUN``: replace ``FRACTION`` of the memory with fresh random bytes, in
  contiguous runs of ``RUN`` bytes at random page-aligned positions: the memory is split into
  strata of ``RUN / FRACTION`` bytes and one run lands at a random page offset inside each, so
  exactly that fraction changes, spread over the whole buffer; result: bytes changed;
* ``scatter FRACTION``: replace ``FRACTION`` of the pages, each a single page (4 KiB) picked at
  random without replacement; result: bytes changed;
* ``touch FRACTION SEED``: read 64 bytes of ``FRACTION`` of the pages, picked at random from
  ``SEED`` (what a step reads first after a restore); result: a SHA-1 of what was read;
* ``touch-runs FRACTION RUN SEED``: read 64 bytes of every page of ``FRACTION`` of the memory,
  in contiguous runs of ``RUN`` bytes placed as ``contig`` places them (from ``SEED``): a step
  that reads its working set in runs; result: a SHA-1 of what was read;
* ``checksum``: result: the hex digest of the whole buffer (BLAKE3, else SHA-1);
* ``exit``: acknowledge and exit 0.

Its stdin, stdout and stderr are what the bench gives it (``/dev/null`` and two log files in
append mode); it writes nothing to them unless it fails. No threads, no sockets, no terminal:
CRIU dumps and restores it with no extra options.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import random
import sys
import time

try:
    import blake3
except ImportError:  # pragma: no cover - cairn depends on blake3; keep the workload standalone
    blake3 = None

PAGE = mmap.PAGESIZE
POLL_S = 0.005
PIECE = 16 << 20  # checksum reads (views, no copies)
# Random bytes are made in small pieces and copied in at once: a large temporary would stay
# behind in the process's heap after it is freed (glibc raises its mmap threshold after the
# first large free), and be dumped, and change from one dump to the next, as if the workload
# had changed more memory than it did.
FILL_PIECE = 1 << 20


def random_bytes(key: bytes, n: int, offset: int = 0) -> bytes:
    """``n`` pseudo-random bytes, from position ``offset`` of the stream named ``key``."""
    if blake3 is None:
        return os.urandom(n)
    return blake3.blake3(key).digest(length=n, seek=offset)


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(text)
    os.rename(tmp, path)


class Memory:
    def __init__(self, size: int, seed: int) -> None:
        self.size = size - size % PAGE
        self.seed = seed
        self.buf = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        key = f"fill-{seed}".encode()
        for start in range(0, self.size, FILL_PIECE):
            n = min(FILL_PIECE, self.size - start)
            self.buf[start:start + n] = random_bytes(key, n, start)

    def contig(self, seq: int, fraction: float, run: int) -> int:
        run -= run % PAGE
        stratum = int(run / fraction)
        stratum -= stratum % PAGE
        if run <= 0 or stratum < run:
            raise ValueError(f"bad run {run} / fraction {fraction}")
        rng = random.Random(f"{self.seed}-{seq}")
        starts = [base + rng.randrange(0, (stratum - run) // PAGE + 1) * PAGE
                  for base in range(0, self.size - stratum + 1, stratum)]
        key = f"contig-{self.seed}-{seq}".encode()
        for i, start in enumerate(starts):
            self.buf[start:start + run] = random_bytes(key, run, i * run)
        return run * len(starts)

    def scatter(self, seq: int, fraction: float) -> int:
        pages = self.size // PAGE
        rng = random.Random(f"{self.seed}-{seq}")
        chosen = rng.sample(range(pages), int(pages * fraction))
        key = f"scatter-{self.seed}-{seq}".encode()
        for i, page in enumerate(chosen):
            self.buf[page * PAGE:(page + 1) * PAGE] = random_bytes(key, PAGE, i * PAGE)
        return PAGE * len(chosen)

    def touch(self, seq: int, fraction: float) -> str:
        """Read ``fraction`` of the pages, picked at random (what a step after a restore
        reads first); a digest of what was read, so a wrong page shows."""
        pages = self.size // PAGE
        rng = random.Random(f"touch-{self.seed}-{seq}")
        h = hashlib.sha1()
        for page in sorted(rng.sample(range(pages), int(pages * fraction))):
            h.update(self.buf[page * PAGE:page * PAGE + 64])
        return h.hexdigest()

    def touch_runs(self, seq: int, fraction: float, run: int) -> str:
        """Read every page of ``fraction`` of the memory in runs of ``run`` bytes (a step's
        working set, as ``contig`` places its runs); a digest of what was read."""
        run -= run % PAGE
        stratum = int(run / fraction)
        stratum -= stratum % PAGE
        if run <= 0 or stratum < run:
            raise ValueError(f"bad run {run} / fraction {fraction}")
        rng = random.Random(f"touch-runs-{self.seed}-{seq}")
        h = hashlib.sha1()
        for base in range(0, self.size - stratum + 1, stratum):
            start = base + rng.randrange(0, (stratum - run) // PAGE + 1) * PAGE
            for page in range(start, start + run, PAGE):
                h.update(self.buf[page:page + 64])
        return h.hexdigest()

    def checksum(self) -> str:
        h = blake3.blake3() if blake3 is not None else hashlib.sha1()
        view = memoryview(self.buf)
        try:
            for start in range(0, self.size, PIECE):
                h.update(view[start:start + PIECE])
        finally:
            view.release()
        return h.hexdigest()


def serve(memory: Memory, directory: str) -> None:
    ctl, ack = os.path.join(directory, "ctl"), os.path.join(directory, "ack")
    last_seq, seen = 0, None
    write_atomic(ack, f"0 ready {os.getpid()} {memory.size}\n")
    while True:
        time.sleep(POLL_S)
        try:
            st = os.stat(ctl)
        except FileNotFoundError:
            continue
        if (st.st_ino, st.st_mtime_ns, st.st_size) == seen:
            continue
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        try:
            with open(ctl, encoding="ascii") as f:
                words = f.read().split()
        except FileNotFoundError:
            continue
        if len(words) < 2 or int(words[0]) <= last_seq:
            continue
        seq, command, args = int(words[0]), words[1], words[2:]
        last_seq = seq
        if command == "contig":
            result = str(memory.contig(seq, float(args[0]), int(args[1])))
        elif command == "scatter":
            result = str(memory.scatter(seq, float(args[0])))
        elif command == "touch":
            result = memory.touch(int(args[1]), float(args[0]))
        elif command == "touch-runs":
            result = memory.touch_runs(int(args[2]), float(args[0]), int(args[1]))
        elif command == "checksum":
            result = memory.checksum()
        elif command == "exit":
            write_atomic(ack, f"{seq} bye\n")
            return
        else:
            result = f"error unknown command {command!r}"
        write_atomic(ack, f"{seq} {result}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    memory = Memory(args.bytes, args.seed)
    serve(memory, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
