"""Throughput of a cairn local store against plain file I/O on the same disk.

What is measured (all sizes from ``--size``, default 1 GiB of random data made once in
memory with :func:`os.urandom`, so nothing dedups or compresses):

* **write**: *baseline* writes the buffer to one new file in ``--io-chunk`` (1 MiB) writes,
  then ``fsync``-s the file and its directory (the same durability a cairn create gives).
  *cairn* times ``store.open_attempt(key)``, ``attempt.snapshot().add_bytes("data.bin",
  buffer)`` and ``commit()`` (durable on return) into a fresh local store each run.
* **read** (cold page cache): *baseline* is a plain sequential read of the baseline file in
  ``--io-chunk`` reads into one reused buffer; *cairn* consumes
  ``store.reader(manifest).iter_file("data.bin")`` fully — the verified streaming read, in
  which every chunk's BLAKE3 digest is checked before the chunk is yielded.
* **restore** (cold page cache, secondary): *baseline* copies the baseline file (read +
  write + ``fsync``); *cairn* runs ``store.restore(key, dest)``, which verifies every chunk
  and fsyncs what it wrote before it returns, so both sides end equally durable.
* **hash**: :func:`cairn.store.hashing.digest` over the buffer in ``max_chunk_bytes`` pieces,
  in GB/s, to show whether hashing could be the bottleneck.

How: every timed side runs ``--runs`` times (default 3) in alternating order (baseline
first on even runs, cairn first on odd runs) to cancel drift; the table shows the median
throughput of each side. Before every timed side the bench runs ``sync`` and drops the page
cache (``echo 3 > /proc/sys/vm/drop_caches``, which needs root); when that is not possible it
says so and marks the read and restore figures as warm-cache. All files live in one fresh
directory (``--dir``, default a temp dir under /var/tmp) on one disk, removed at the end.
MB and GB are 10**6 and 10**9 bytes. The last line printed is one JSON object with every
figure, including ``write_ratio`` and ``read_ratio`` (cairn / baseline throughput).

StoreSettings can be varied from the command line (``--pack-bytes 64M --io-threads 4`` ...)
to see which settings give what. ``--precreate-pack-dirs`` creates the store's 256 pack
fan-out directories (``packs/00`` .. ``packs/ff``) before the timed write, as they exist in
a store that already holds a few hundred packs; a fresh store creates (and fsyncs) them
during the first snapshots, which the default run measures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from benchenv import drop_caches, fsync_path, remove  # bench/ is on sys.path when run as a script
from cairn.store import Key, Store, StoreSettings, open_store
from cairn.store.hashing import digest
from cairn.store.packs import PACKS_PREFIX

KEY = Key.parse("bench/store/run")
FILE_NAME = "data.bin"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``1G``, ``256M``, ``512KiB``, ``1048576`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r}; use e.g. 256M or 1G")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return size


def human(size: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


# -- the two sides of each operation --------------------------------------------------------


def baseline_write(path: str, data: memoryview, io_chunk: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for start in range(0, len(data), io_chunk):
            piece = data[start:start + io_chunk]
            while piece:
                piece = piece[os.write(fd, piece):]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(os.path.dirname(path), directory=True)


def baseline_read(path: str, io_chunk: int) -> int:
    buffer = bytearray(io_chunk)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            total += n
    return total


def baseline_copy(src: str, dest: str, io_chunk: int) -> None:
    buffer = bytearray(io_chunk)
    view = memoryview(buffer)
    with open(src, "rb", buffering=0) as f:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while n := f.readinto(buffer):
                piece = view[:n]
                while piece:
                    piece = piece[os.write(fd, piece):]
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_path(os.path.dirname(dest), directory=True)


def cairn_write(store: Store, data: memoryview) -> None:
    attempt = store.open_attempt(KEY)
    with attempt.snapshot() as snap:
        snap.add_bytes(FILE_NAME, data)
        snap.commit()


def cairn_read(store: Store) -> int:
    manifest = store.manifest(KEY)
    total = 0
    for piece in store.reader(manifest).iter_file(FILE_NAME):
        total += len(piece)
    return total


def cairn_restore(store: Store, dest: str) -> None:
    """Verified restore; durable when it returns."""
    store.restore(KEY, dest)


# -- the benchmark --------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, root: str, data: memoryview,
                 settings: StoreSettings) -> None:
        self.args = args
        self.root = root
        self.data = data
        self.size = len(data)
        self.settings = settings
        self.cold = True
        self.baseline_path = os.path.join(root, "baseline.bin")
        self.store_dir = os.path.join(root, "store")

    def prepare(self) -> None:
        """sync + drop caches before a timed side; remembers whether dropping ever failed."""
        if not drop_caches():
            self.cold = False

    def timed(self, fn: Callable[[], Any]) -> float:
        self.prepare()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def alternate(self, runs: int, base: Callable[[int], float],
                  cairn: Callable[[int], float]) -> tuple[list[float], list[float]]:
        base_s: list[float] = []
        cairn_s: list[float] = []
        for run in range(runs):
            order = [("b", base), ("c", cairn)] if run % 2 == 0 else [("c", cairn), ("b", base)]
            for side, fn in order:
                (base_s if side == "b" else cairn_s).append(fn(run))
        return base_s, cairn_s

    def write(self) -> tuple[list[float], list[float]]:
        io_chunk = self.args.io_chunk

        def base(run: int) -> float:
            remove(self.baseline_path)
            return self.timed(lambda: baseline_write(self.baseline_path, self.data, io_chunk))

        def cairn(run: int) -> float:
            remove(self.store_dir)
            store = open_store(self.store_dir, settings=self.settings)
            if self.args.precreate_pack_dirs:
                for i in range(256):
                    os.makedirs(os.path.join(self.store_dir, PACKS_PREFIX, f"{i:02x}"))
            try:
                return self.timed(lambda: cairn_write(store, self.data))
            finally:
                store.close()

        return self.alternate(self.args.runs, base, cairn)

    def read(self) -> tuple[list[float], list[float]]:
        io_chunk = self.args.io_chunk

        def base(run: int) -> float:
            got: list[int] = []
            seconds = self.timed(lambda: got.append(baseline_read(self.baseline_path, io_chunk)))
            assert got[0] == self.size, got
            return seconds

        def cairn(run: int) -> float:
            store = open_store(self.store_dir, settings=self.settings, create=False)
            got: list[int] = []
            try:
                seconds = self.timed(lambda: got.append(cairn_read(store)))
            finally:
                store.close()
            assert got[0] == self.size, got
            return seconds

        return self.alternate(self.args.runs, base, cairn)

    def restore(self) -> tuple[list[float], list[float]]:
        io_chunk = self.args.io_chunk
        copy_path = os.path.join(self.root, "copy.bin")
        dest = os.path.join(self.root, "restored")

        def base(run: int) -> float:
            remove(copy_path)
            return self.timed(lambda: baseline_copy(self.baseline_path, copy_path, io_chunk))

        def cairn(run: int) -> float:
            remove(dest)
            store = open_store(self.store_dir, settings=self.settings, create=False)
            try:
                seconds = self.timed(lambda: cairn_restore(store, dest))
            finally:
                store.close()
            if run == 0 and os.path.getsize(os.path.join(dest, FILE_NAME)) != self.size:
                raise AssertionError("restored file has the wrong size")
            return seconds

        try:
            base_s, cairn_s = self.alternate(self.args.runs, base, cairn)
        finally:
            remove(copy_path)
            remove(dest)
        return base_s, cairn_s

    def hashing(self) -> float:
        chunk = self.settings.max_chunk_bytes
        best = 0.0
        for _ in range(max(1, self.args.runs)):
            start = time.perf_counter()
            for offset in range(0, self.size, chunk):
                digest(self.data[offset:offset + chunk])
            best = max(best, self.size / (time.perf_counter() - start) / 1e9)
        return best


def mbps(size: int, seconds: list[float]) -> list[float]:
    return [size / s / 1e6 for s in seconds]


def build_settings(args: argparse.Namespace) -> StoreSettings:
    overrides: dict[str, int] = {}
    for name in ("max_chunk_bytes", "pack_bytes", "max_inflight_packs", "io_threads",
                 "read_prefetch"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    return StoreSettings(**overrides)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=1 << 30,
                        help="bytes of random data (e.g. 256M, 1G; default 1G)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per side (default 3)")
    parser.add_argument("--dir", default=None,
                        help="parent directory for the bench files (default: a temp dir "
                             "under /var/tmp); a fresh subdirectory is made and removed")
    parser.add_argument("--io-chunk", type=parse_size, default=1 << 20,
                        help="baseline read/write size (default 1M)")
    parser.add_argument("--no-restore", action="store_true", help="skip the restore rows")
    parser.add_argument("--precreate-pack-dirs", action="store_true",
                        help="create packs/00..ff in each fresh store before the timed write "
                             "(as in a store that already holds data)")
    group = parser.add_argument_group("StoreSettings overrides (default: cairn's defaults)")
    group.add_argument("--max-chunk-bytes", type=parse_size)
    group.add_argument("--pack-bytes", type=parse_size)
    group.add_argument("--max-inflight-packs", type=int)
    group.add_argument("--io-threads", type=int)
    group.add_argument("--read-prefetch", type=int)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = build_settings(args)
    parent = args.dir or "/var/tmp"
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    need = 3 * args.size + (64 << 20)  # baseline + store + restore/copy at once
    if free < need:
        print(f"not enough free space in {parent}: {free / 1e9:.1f} GB free, "
              f"{need / 1e9:.1f} GB needed", file=sys.stderr)
        return 2

    print(f"generating {human(args.size)} of random data ...", flush=True)
    data = memoryview(os.urandom(args.size))
    root = tempfile.mkdtemp(prefix="cairn-bench-", dir=parent)
    print(f"bench dir {root}; {args.runs} runs per side; settings {asdict(settings)}", flush=True)

    bench = Bench(args, root, data, settings)
    results: dict[str, Any] = {}
    try:
        hash_gbps = bench.hashing()
        print(f"hash: {hash_gbps:.2f} GB/s", flush=True)
        w_base, w_cairn = bench.write()
        print("write done", flush=True)
        r_base, r_cairn = bench.read()
        print("read done", flush=True)
        results["write"] = (mbps(args.size, w_base), mbps(args.size, w_cairn))
        results["read"] = (mbps(args.size, r_base), mbps(args.size, r_cairn))
        if not args.no_restore:
            s_base, s_cairn = bench.restore()
            print("restore done", flush=True)
            results["restore"] = (mbps(args.size, s_base), mbps(args.size, s_cairn))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    cold = bench.cold
    if not cold:
        print("NOTE: could not drop the page cache (needs root: echo 3 > "
              "/proc/sys/vm/drop_caches); read and restore figures are WARM-CACHE", flush=True)
    labels = {"write": "write (durable)",
              "read": "read (verified)" + ("" if cold else " [warm cache]"),
              "restore": "restore/copy + fsync" + ("" if cold else " [warm cache]")}
    summary: dict[str, Any] = {}
    print()
    print(f"{'operation':<34} {'baseline MB/s':>14} {'cairn MB/s':>12} {'cairn/baseline':>15}")
    print("-" * 78)
    for op, (base, cairn) in results.items():
        b, c = statistics.median(base), statistics.median(cairn)
        summary[op] = {"baseline_mbps": round(b, 1), "cairn_mbps": round(c, 1),
                       "ratio": round(c / b, 3),
                       "baseline_runs_mbps": [round(x, 1) for x in base],
                       "cairn_runs_mbps": [round(x, 1) for x in cairn]}
        print(f"{labels[op]:<34} {b:>14.1f} {c:>12.1f} {c / b:>15.2f}")
    print(f"{'hash (cairn digest, ' + human(settings.max_chunk_bytes) + ' chunks)':<34} "
          f"{'':>14} {hash_gbps * 1000:>12.1f}")
    print()
    out = {
        "write_ratio": summary["write"]["ratio"],
        "read_ratio": summary["read"]["ratio"],
        "restore_ratio": summary["restore"]["ratio"] if "restore" in summary else None,
        "hash_gbps": round(hash_gbps, 3),
        "size_bytes": args.size,
        "io_chunk_bytes": args.io_chunk,
        "runs": args.runs,
        "cold_cache": cold,
        "precreate_pack_dirs": args.precreate_pack_dirs,
        "settings": asdict(settings),
        **summary,
    }
    print(json.dumps(out, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
