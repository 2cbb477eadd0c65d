"""A 2-rank FSDP2 snapshot resumed on 1 and on 3 ranks, as a user waits for it (issue 35).

The state (an FSDP2 model of ``--layers`` linear layers of ``--width`` squared, and Adam's two
moments: 1.6 GB at the defaults) is saved once by 2 ranks, twice over: a cairn snapshot in a
local store, and ``dcp.save`` with ``FileSystemWriter`` (DCP's own layout) in a directory of the
same disk. Then, for 1 and 3 ranks, each side's torchrun command is timed from its start until
rank 0 says every rank is ready to train, page cache dropped before each:

* **cairn**: ``Checkpointer.restore(model=, optimizer=)``: every part's pieces read, verified
  and resharded through cairn's DCP reader (``cairn.dcp.StoreReader``);
* **dcp** (the peer's best: DCP's documented recipe): ``get_state_dict``, ``dcp.load`` from
  ``FileSystemReader``, ``set_state_dict``.

Both build the model the same way (on the ``meta`` device, pieces allocated after
``fully_shard``, nothing initialised). Every run's whole state (parameters and moments) must
digest to what the source saved. Target: cairn / dcp <= 1.0. ``load`` is the load call alone
(a breakdown, not the target); ``floor`` reads the DCP directory's files cold, one thread, 4
MiB reads. The sides alternate which goes first. Needs root (to drop the page cache).

    python bench/resize_bench.py [--runs N] [--width D] [--layers L] [--smoke] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Any

from benchenv import BenchError, drop_caches, loadavg, remove

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(HERE, "resize_workload.py")
TARGET = 1.0
PEER = ("torch.distributed.checkpoint: dcp.save(FileSystemWriter) by the 2 source ranks; "
        "on M ranks get_state_dict + dcp.load(FileSystemReader) + set_state_dict")


def torchrun(ranks: int, mode: str, args: argparse.Namespace, root: str, *, timeout: float
             ) -> dict[str, Any]:
    """One torchrun command: seconds from its start to rank 0's ``ready``, the load call's
    seconds, and the state's digest."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}", WORKLOAD, mode, "--store", os.path.join(root, "store"),
            "--key", "bench/resize/run-1/0", "--dcp", os.path.join(root, "dcp"),
            "--width", str(args.width), "--layers", str(args.layers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=HERE, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    ready_s: float | None = None
    load_s = 0.0
    found = None
    for line in proc.stdout:
        if ready_s is None and (m := re.match(r"ready (\S+) (\S+)", line)):
            ready_s, load_s = time.monotonic() - started, float(m[2])
        elif m := re.match(r"digest (\S+)", line):
            found = m[1]
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise BenchError(f"{mode} on {ranks} ranks did not finish in {timeout:.0f}s") from None
    if proc.returncode != 0 or found is None:
        raise BenchError(f"{mode} on {ranks} ranks failed ({proc.returncode}):\n{err[-3000:]}")
    return {"ready_s": ready_s, "load_s": load_s, "digest": found}


def floor(root: str) -> tuple[float, int]:
    """Seconds to read the DCP directory's files cold (one thread, 4 MiB reads), and bytes."""
    drop_caches()
    total, began = 0, time.monotonic()
    directory = os.path.join(root, "dcp")
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            while chunk := f.read(4 << 20):
                total += len(chunk)
    return time.monotonic() - began, total


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--to", default="1,3", help="the rank counts to load on")
    parser.add_argument("--dir", default=None, help="where the bench's directory goes")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--smoke", action="store_true",
                        help="a 256-wide, 2-layer model, one run (~1 min)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.layers, args.runs = 256, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("resize_bench: needs root (it drops the page cache)", file=sys.stderr)
        return 2
    targets = [int(m) for m in args.to.split(",")]
    root = tempfile.mkdtemp(prefix="resize-bench-", dir=args.dir)
    load_start = loadavg()
    began = time.monotonic()
    try:
        print(f"resize_bench in {root}; peer: {PEER}", file=sys.stderr, flush=True)
        source = torchrun(2, "source", args, root, timeout=args.timeout)
        floor_s, state_bytes = floor(root)
        rows, runs = [], {}
        for ranks in targets:
            seen: list[dict[str, Any]] = []
            for run in range(args.runs):
                figures = {}
                order = ("cairn", "dcp") if (run + ranks) % 2 == 0 else ("dcp", "cairn")
                for side in order:
                    drop_caches()
                    got = torchrun(ranks, side, args, root, timeout=args.timeout)
                    if got["digest"] != source["digest"]:
                        raise BenchError(f"{side} on {ranks} ranks does not verify: "
                                         f"{got['digest']} != {source['digest']}")
                    figures[side] = {k: got[k] for k in ("ready_s", "load_s")}
                    print(f"  2 -> {ranks} run {run} {side:5s} ready {got['ready_s']:.2f}s "
                          f"load {got['load_s']:.2f}s verified", file=sys.stderr, flush=True)
                seen.append(figures)
            runs[f"2->{ranks}"] = seen
            cairn = median(r["cairn"]["ready_s"] for r in seen)
            dcp = median(r["dcp"]["ready_s"] for r in seen)
            rows.append({"from_ranks": 2, "to_ranks": ranks, "dcp_ready_s": round(dcp, 4),
                         "cairn_ready_s": round(cairn, 4), "ratio": round(cairn / dcp, 3),
                         "met": cairn / dcp <= TARGET,
                         "dcp_load_s": round(median(r["dcp"]["load_s"] for r in seen), 4),
                         "cairn_load_s": round(median(r["cairn"]["load_s"] for r in seen), 4),
                         "floor_s": round(floor_s, 4), "state_bytes": state_bytes,
                         "verified": True, "runs": len(seen)})
    finally:
        remove(root)
    print(f"resize restore, 2-rank FSDP2 snapshot, page cache dropped before each side; peer: "
          f"{PEER}")
    print(f"{'ranks':>7} {'dcp':>6} {'cairn':>6} {'ratio <=1.0':>12} {'d.load':>7} "
          f"{'c.load':>7} {'floor':>6} {'state':>8}")
    for row in rows:
        print(f"{'2 -> ' + str(row['to_ranks']):>7} {row['dcp_ready_s']:6.2f} "
              f"{row['cairn_ready_s']:6.2f} {row['ratio']:6.3f} {'met' if row['met'] else 'MISSED':>5} "
              f"{row['dcp_load_s']:7.2f} {row['cairn_load_s']:7.2f} {row['floor_s']:6.2f} "
              f"{row['state_bytes'] / 1e6:7.0f}M")
    print("columns, seconds (medians): dcp/cairn = the torchrun command's start until every "
          "rank is ready to train; ratio = cairn/dcp (target <= 1.0); d.load/c.load = the load "
          "call alone (breakdown); floor = the DCP files read cold, one thread; state = their "
          "bytes")
    print(json.dumps({"bench": "resize", "peer": PEER, "cold_cache": True,
                      "all_verified": True, "rows": rows, "runs": runs,
                      "targets": {"ratio": TARGET},
                      "settings": {"width": args.width, "layers": args.layers,
                                   "runs": args.runs, "to": targets},
                      "loadavg_start": load_start, "loadavg_end": loadavg(),
                      "wall_s": round(time.monotonic() - began, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
