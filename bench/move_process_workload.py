"""The process that ``move_bench.py --process`` runs under ``cairn run``, suspends and moves:
``--bytes`` of pseudo-random private memory, and a step that reads all of it.

    python bench/move_process_workload.py --bytes N --metrics FILE

Each step hashes the whole buffer (it reads every page, as a training step reads its weights)
and appends ``step STEP T`` to ``FILE`` (``T``: seconds since the Unix epoch), opened in append
mode and by path, so a restored process goes on appending to it. No threads, no sockets, no
terminal: CRIU dumps and restores it with no extra options.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import time

try:
    import blake3
except ImportError:  # pragma: no cover - cairn depends on blake3
    blake3 = None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--steps", type=int, default=100_000)
    args = parser.parse_args()
    buf = mmap.mmap(-1, args.bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    piece = 64 << 20
    for offset in range(0, args.bytes, piece):
        n = min(piece, args.bytes - offset)
        data = (blake3.blake3(offset.to_bytes(8, "little")).digest(length=n) if blake3
                else hashlib.shake_256(offset.to_bytes(8, "little")).digest(n))
        buf[offset:offset + n] = data
    with open(args.metrics, "a", buffering=1) as metrics:
        for step in range(args.steps):
            (blake3.blake3 if blake3 else hashlib.sha1)(buf).hexdigest()
            metrics.write(f"step {step} {time.time():.6f}\n")
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
