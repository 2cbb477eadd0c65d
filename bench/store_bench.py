"""Throughput of a cairn local store against plain file I/O on the same disk.

What is measured (all sizes from ``--size``, default 1 GiB of random data made once in
memory with :func:`os.urandom`, so nothing dedups or compresses):

* **write**: two baselines, and cairn's ratio is against the faster (a comparison counts only
  against the peer's best configuration). *serial* writes the buffer to one new file in
  ``--io-chunk`` (1 MiB) writes, then ``fsync``-s the file and its directory (the durability a
  cairn commit gives); *parallel* is a tuned copy: ``--writers`` threads (default 4) each
  ``pwrite`` one contiguous share of the file in ``--io-chunk`` pieces, then one ``fsync`` of
  the file and its directory. *cairn* times ``store.open_attempt(key)``,
  ``attempt.snapshot().add_bytes("data.bin", buffer)`` and ``commit()`` (durable on return)
  into a fresh local store each run.
* **read** (cold page cache): *baseline* is a plain sequential read of the baseline file in
  ``--io-chunk`` reads into one reused buffer; *cairn* consumes
  ``store.reader(manifest).iter_file("data.bin")`` fully — the verified streaming read, in
  which every chunk's BLAKE3 digest is checked before the chunk is yielded.
* **restore** (cold page cache, secondary): *baseline* copies the baseline file (read +
  write + ``fsync``); *cairn* runs ``store.restore(key, dest)``, which verifies every chunk
  and fsyncs what it wrote before it returns, so both sides end equally durable.
* **hash**: :func:`cairn.store.hashing.digest` over the buffer in ``max_chunk_bytes`` pieces,
  in GB/s, the median of ``--runs`` passes, to show whether hashing could be the bottleneck.

How: every timed side runs ``--runs`` times (default 3) in rotating order (a different side
first on each run) to cancel drift; the table shows the median throughput of each side.
Before every timed side the bench runs ``sync`` and drops the page cache (``echo 3 >
/proc/sys/vm/drop_caches``, which needs root); when that is not possible it says so and marks
the read and restore figures as warm-cache. All files live in one fresh directory (``--dir``,
default a temp dir under /var/tmp) on one disk, removed at the end. MB and GB are 10**6 and
10**9 bytes.

Where time goes: every timed side charges its parts (write, fsync, hash, read, verify, ...) to
a :class:`benchenv.Timers`; cairn's parts are timed by wrapping the library's functions for
the duration of the side (:func:`benchenv.timed_attributes`: a clock read per call of 1 MiB or
more). Under the table, per side, the mean seconds of each part on the timing thread, which
add up to the total with ``other``, and the busy seconds of each part on pool threads, which
overlap it. The exact configuration of every peer is printed, and in the JSON. The last line
printed is one JSON object with every figure, including ``write_ratio`` and ``read_ratio``
(cairn / baseline throughput) and the targets (``write_ratio`` >= 0.8, ``read_ratio`` >= 0.9).

StoreSettings can be varied from the command line (``--pack-bytes 64M --io-threads 4`` ...)
to see which settings give what. ``--precreate-pack-dirs`` creates the store's 256 pack
fan-out directories (``packs/00`` .. ``packs/ff``) before the timed write, as they exist in
a store that already holds a few hundred packs; a fresh store creates (and fsyncs) them
during the first snapshots, which the default run measures. ``--quick`` is a smoke run
(32 MiB, 2 runs per side).
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from benchenv import (  # bench/ is on sys.path when run as a script
    Timers,
    drop_caches,
    fsync_path,
    loadavg,
    mean_breakdown,
    print_breakdowns,
    print_peers,
    remove,
    store_read_parts,
    store_write_parts,
    timed_attributes,
)
from cairn.store import Key, Store, StoreSettings
from cairn import open_store
from cairn.store.fileops import OsFileOps
from cairn.store.hashing import digest
from cairn.store.packs import PACKS_PREFIX

KEY = Key.parse("bench/store/run")
FILE_NAME = "data.bin"
TARGETS = {"write_ratio": 0.8, "read_ratio": 0.9}  # cairn / the best baseline, at least
QUICK_SIZE = 32 << 20
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# What each cairn side's breakdown times: (owner, attribute, part). Calls nested in a timed
# call on the same thread count once, for the outer part (fsync inside fsync_dir).
WRITE_PARTS = store_write_parts()
READ_PARTS = store_read_parts()
RESTORE_PARTS = [*READ_PARTS, (OsFileOps, "fsync_dir", "fsync_dir"), (os, "fsync", "fsync")]


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


# -- the sides of each operation ------------------------------------------------------------


def _write_all(fd: int, piece: memoryview, offset: int | None = None) -> None:
    while piece:
        written = os.write(fd, piece) if offset is None else os.pwrite(fd, piece, offset)
        piece = piece[written:]
        if offset is not None:
            offset += written


def _make_durable(fd: int, path: str, timers: Timers) -> None:
    """fsync the file, then its directory: the durability a cairn commit gives."""
    with timers.timing("fsync"):
        os.fsync(fd)
    with timers.timing("fsync_dir"):
        fsync_path(os.path.dirname(path), directory=True)


def baseline_write(path: str, data: memoryview, io_chunk: int, timers: Timers) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with timers.timing("write"):
            for start in range(0, len(data), io_chunk):
                _write_all(fd, data[start:start + io_chunk])
        _make_durable(fd, path, timers)
    finally:
        os.close(fd)


def parallel_write(path: str, data: memoryview, io_chunk: int, writers: int,
                   timers: Timers) -> None:
    """A tuned copy: ``writers`` threads each ``pwrite`` one contiguous share of the file in
    ``io_chunk`` pieces, so that copying into the page cache and starting writeback run on
    several cores at once; then one fsync of the file and its directory."""
    share = -(-len(data) // writers)

    def write_share(index: int) -> None:
        low, high = index * share, min(len(data), (index + 1) * share)
        with timers.timing("write"):
            for start in range(low, high, io_chunk):
                _write_all(fd, data[start:min(high, start + io_chunk)], start)

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with timers.timing("wait_for_writers"), \
                ThreadPoolExecutor(writers, thread_name_prefix="bench-writer") as pool:
            list(pool.map(write_share, range(writers)))
        _make_durable(fd, path, timers)
    finally:
        os.close(fd)


def baseline_read(path: str, io_chunk: int, timers: Timers) -> int:
    buffer = bytearray(io_chunk)
    total = 0
    with open(path, "rb", buffering=0) as f, timers.timing("read"):
        while n := f.readinto(buffer):
            total += n
    return total


def baseline_copy(src: str, dest: str, io_chunk: int, timers: Timers) -> None:
    buffer = bytearray(io_chunk)
    view = memoryview(buffer)
    with open(src, "rb", buffering=0) as f:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while True:
                with timers.timing("read"):
                    n = f.readinto(buffer)
                if not n:
                    break
                with timers.timing("write"):
                    _write_all(fd, view[:n])
            _make_durable(fd, dest, timers)
        finally:
            os.close(fd)


def cairn_write(store: Store, data: memoryview, timers: Timers) -> None:
    attempt = store.open_attempt(KEY)
    with attempt.snapshot() as snap:
        snap.add_bytes(FILE_NAME, data)
        snap.commit()


def cairn_read(store: Store, timers: Timers) -> int:
    manifest = store.manifest(KEY)
    total = 0
    pieces = iter(store.reader(manifest).iter_file(FILE_NAME))
    while True:
        with timers.timing("wait_for_verified_data"):
            piece = next(pieces, None)
        if piece is None:
            return total
        total += len(piece)


def cairn_restore(store: Store, dest: str, timers: Timers) -> None:
    """Verified restore; durable when it returns."""
    store.restore(KEY, dest)


# -- the peers, as the output names them ----------------------------------------------------


def peer_configs(args: argparse.Namespace, settings: StoreSettings) -> dict[str, str]:
    chunk = human(args.io_chunk)
    return {
        "write_serial": f"1 writer: {chunk} os.write calls to one new file + fsync of the file "
                        "and its directory",
        "write_parallel": f"cp-like writer with {args.writers} threads: each pwrites one "
                          f"contiguous share of one new file in {chunk} pieces, then fsync of "
                          "the file and its directory",
        "read": f"1 reader: sequential {chunk} readinto calls into one reused buffer",
        "restore": f"copy: {chunk} read + write to a new file, fsync of the file and its "
                   "directory",
        "cairn_write": "open_attempt + snapshot().add_bytes + commit() into a fresh local "
                       f"store ({human(settings.max_chunk_bytes)} chunks, "
                       f"{human(settings.pack_bytes)} packs, {settings.io_threads} io threads)",
        "cairn_read": "store.reader(manifest).iter_file, every chunk's BLAKE3 checked "
                      f"(read_prefetch {settings.read_prefetch})",
        "cairn_restore": "store.restore(key, dest): verified, fsyncs every file and directory",
    }


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
        self.profiles: dict[str, list[tuple[float, Timers]]] = {}

    def prepare(self) -> None:
        """sync + drop caches before a timed side; remembers whether dropping ever failed."""
        if not drop_caches():
            self.cold = False

    def timed(self, side: str, fn: Callable[[Timers], Any],
              parts: Sequence[tuple[Any, str, str]] = ()) -> float:
        """One timed run of ``side``; its seconds and its parts go to ``self.profiles``."""
        self.prepare()
        timers = Timers()
        with timed_attributes(timers, parts):
            start = time.perf_counter()
            fn(timers)
            seconds = time.perf_counter() - start
        self.profiles.setdefault(side, []).append((seconds, timers))
        return seconds

    def alternate(self, sides: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
        """``--runs`` runs of every side, a different side first on each run (drift cancels)."""
        names = list(sides)
        out: dict[str, list[float]] = {name: [] for name in names}
        for run in range(self.args.runs):
            shift = run % len(names)
            for name in names[shift:] + names[:shift]:
                out[name].append(sides[name]())
        return out

    def fresh_store(self) -> Store:
        remove(self.store_dir)
        store = open_store(self.store_dir, settings=self.settings)
        if self.args.precreate_pack_dirs:
            for i in range(256):
                os.makedirs(os.path.join(self.store_dir, PACKS_PREFIX, f"{i:02x}"))
        return store

    def write(self) -> dict[str, list[float]]:
        io_chunk, writers = self.args.io_chunk, self.args.writers

        def serial() -> float:
            remove(self.baseline_path)
            return self.timed("write_serial", lambda t: baseline_write(
                self.baseline_path, self.data, io_chunk, t))

        def parallel() -> float:
            remove(self.baseline_path)
            return self.timed("write_parallel", lambda t: parallel_write(
                self.baseline_path, self.data, io_chunk, writers, t))

        def cairn() -> float:
            store = self.fresh_store()
            try:
                return self.timed("cairn_write", lambda t: cairn_write(store, self.data, t),
                                  WRITE_PARTS)
            finally:
                store.close()

        return self.alternate({"write_serial": serial, "write_parallel": parallel,
                               "cairn_write": cairn})

    def read(self) -> dict[str, list[float]]:
        io_chunk = self.args.io_chunk

        def checked(side: str, fn: Callable[[Timers], int],
                    parts: Sequence[tuple[Any, str, str]]) -> float:
            got: list[int] = []
            seconds = self.timed(side, lambda t: got.append(fn(t)), parts)
            assert got[0] == self.size, got
            return seconds

        def base() -> float:
            return checked("read", lambda t: baseline_read(self.baseline_path, io_chunk, t), [])

        def cairn() -> float:
            store = open_store(self.store_dir, settings=self.settings, create=False)
            try:
                return checked("cairn_read", lambda t: cairn_read(store, t), READ_PARTS)
            finally:
                store.close()

        return self.alternate({"read": base, "cairn_read": cairn})

    def restore(self) -> dict[str, list[float]]:
        io_chunk = self.args.io_chunk
        copy_path = os.path.join(self.root, "copy.bin")
        dest = os.path.join(self.root, "restored")

        def base() -> float:
            remove(copy_path)
            return self.timed("restore", lambda t: baseline_copy(
                self.baseline_path, copy_path, io_chunk, t))

        def cairn() -> float:
            remove(dest)
            store = open_store(self.store_dir, settings=self.settings, create=False)
            try:
                seconds = self.timed("cairn_restore", lambda t: cairn_restore(store, dest, t),
                                     RESTORE_PARTS)
            finally:
                store.close()
            if os.path.getsize(os.path.join(dest, FILE_NAME)) != self.size:
                raise AssertionError("restored file has the wrong size")
            return seconds

        try:
            return self.alternate({"restore": base, "cairn_restore": cairn})
        finally:
            remove(copy_path)
            remove(dest)

    def hashing(self) -> list[float]:
        """GB/s of each of ``--runs`` passes (the table shows the median: a maximum would
        report the luckiest pass on a shared machine)."""
        chunk = self.settings.max_chunk_bytes
        rates = []
        for _ in range(self.args.runs):
            start = time.perf_counter()
            for offset in range(0, self.size, chunk):
                digest(self.data[offset:offset + chunk])
            rates.append(self.size / (time.perf_counter() - start) / 1e9)
        return rates

    def breakdowns(self) -> dict[str, dict[str, Any]]:
        """Per side: the mean over its runs of the total and of each part."""
        return {side: mean_breakdown(runs) for side, runs in self.profiles.items()}


def mbps(size: int, seconds: list[float]) -> list[float]:
    return [size / s / 1e6 for s in seconds]


def build_settings(args: argparse.Namespace) -> StoreSettings:
    overrides: dict[str, int] = {}
    for name in ("max_chunk_bytes", "pack_bytes", "max_inflight_packs", "io_threads",
                 "read_prefetch"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    return StoreSettings(**overrides).resolved(remote=False)  # the bench's stores are local


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=None,
                        help="bytes of random data (e.g. 256M, 1G; default 1G, 32M with --quick)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed runs per side (default 3, 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 32 MiB, 2 runs per side (the test suite runs this)")
    parser.add_argument("--dir", default=None,
                        help="parent directory for the bench files (default: a temp dir "
                             "under /var/tmp); a fresh subdirectory is made and removed")
    parser.add_argument("--io-chunk", type=parse_size, default=1 << 20,
                        help="baseline read/write size (default 1M)")
    parser.add_argument("--writers", type=int, default=4,
                        help="threads of the parallel write baseline (default 4)")
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
    if args.size is None:
        args.size = QUICK_SIZE if args.quick else 1 << 30
    if args.runs is None:
        args.runs = 2 if args.quick else 3
    if args.runs < 1 or args.writers < 1:
        parser.error("--runs and --writers must be at least 1")
    return args


# -- the report -----------------------------------------------------------------------------

# op -> (label, its baseline sides, cairn's side)
OPS = {"write": ("write (durable)", ["write_serial", "write_parallel"], "cairn_write"),
       "read": ("read (verified)", ["read"], "cairn_read"),
       "restore": ("restore/copy + fsync", ["restore"], "cairn_restore")}


def summarize(size: int, times: dict[str, list[float]]) -> dict[str, Any]:
    """Per operation: each side's median MB/s and cairn's ratio against the fastest baseline."""
    summary: dict[str, Any] = {}
    for op, (_, bases, cairn) in OPS.items():
        if cairn not in times:
            continue
        rates = {side: mbps(size, times[side]) for side in [*bases, cairn]}
        medians = {side: statistics.median(r) for side, r in rates.items()}
        best = max(bases, key=lambda side: medians[side])
        summary[op] = {
            "baseline": best, "baseline_mbps": round(medians[best], 1),
            "cairn_mbps": round(medians[cairn], 1),
            "ratio": round(medians[cairn] / medians[best], 3),
            "baseline_runs_mbps": [round(x, 1) for x in rates[best]],
            "cairn_runs_mbps": [round(x, 1) for x in rates[cairn]],
            "baselines": {side: {"mbps": round(medians[side], 1),
                                 "ratio": round(medians[cairn] / medians[side], 3),
                                 "runs_mbps": [round(x, 1) for x in rates[side]]}
                          for side in bases},
        }
    return summary


def print_table(summary: dict[str, Any], cold: bool, hash_gbps: float, chunk: int) -> None:
    warm = "" if cold else " [warm cache]"
    print(f"{'operation':<26} {'side':<24} {'MB/s':>9} {'cairn/side':>11}")
    print("-" * 73)
    for op, row in summary.items():
        label, bases, cairn = OPS[op]
        label += warm if op != "write" else ""
        for side in bases:
            mark = " *" if side == row["baseline"] else ""
            b = row["baselines"][side]
            print(f"{label:<26} {side:<24} {b['mbps']:>9.1f} {b['ratio']:>11.3f}{mark}")
            label = ""
        print(f"{label:<26} {cairn:<24} {row['cairn_mbps']:>9.1f}")
    print(f"{'hash (median of runs)':<26} {'cairn digest, ' + human(chunk):<24} "
          f"{hash_gbps * 1000:>9.1f}")
    print("(* the faster baseline, which the ratio uses)")


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
    load_start = loadavg()

    print(f"generating {human(args.size)} of random data ...", flush=True)
    data = memoryview(os.urandom(args.size))
    root = tempfile.mkdtemp(prefix="cairn-bench-", dir=parent)
    print(f"bench dir {root}; {args.runs} runs per side; settings {asdict(settings)}", flush=True)

    bench = Bench(args, root, data, settings)
    times: dict[str, list[float]] = {}
    try:
        hash_runs = bench.hashing()
        hash_gbps = statistics.median(hash_runs)
        print(f"hash: {hash_gbps:.2f} GB/s (median)", flush=True)
        times.update(bench.write())
        print("write done", flush=True)
        times.update(bench.read())
        print("read done", flush=True)
        if not args.no_restore:
            times.update(bench.restore())
            print("restore done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    cold = bench.cold
    if not cold:
        print("NOTE: could not drop the page cache (needs root: echo 3 > "
              "/proc/sys/vm/drop_caches); read and restore figures are WARM-CACHE", flush=True)
    summary = summarize(args.size, times)
    peers = peer_configs(args, settings)
    parts = bench.breakdowns()
    print()
    print_table(summary, cold, hash_gbps, settings.max_chunk_bytes)
    print()
    print_peers(peers, width=16)
    print()
    print_breakdowns("mean of runs", parts, width=16)
    figures = {"write_ratio": summary["write"]["ratio"], "read_ratio": summary["read"]["ratio"]}
    targets = {k: {"value": v, "target": TARGETS[k], "met": v >= TARGETS[k]}
               for k, v in figures.items()}
    print()
    print(f"{'target':<14} {'value':>8} {'>=':>6}  met")
    for k, t in targets.items():
        print(f"{k:<14} {t['value']:>8.3f} {t['target']:>6.2f}  {'yes' if t['met'] else 'NO'}")
    print()
    out = {
        **figures,
        "restore_ratio": summary["restore"]["ratio"] if "restore" in summary else None,
        "write_ratio_vs_serial": summary["write"]["baselines"]["write_serial"]["ratio"],
        "write_ratio_vs_parallel": summary["write"]["baselines"]["write_parallel"]["ratio"],
        "hash_gbps": round(hash_gbps, 3),
        "hash_runs_gbps": [round(x, 3) for x in hash_runs],
        "targets": targets,
        "peers": peers,
        "breakdown": parts,
        "size_bytes": args.size,
        "io_chunk_bytes": args.io_chunk,
        "writers": args.writers,
        "runs": args.runs,
        "cold_cache": cold,
        "precreate_pack_dirs": args.precreate_pack_dirs,
        "settings": asdict(settings),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        **summary,
    }
    print(json.dumps(out, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
