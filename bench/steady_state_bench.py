"""What periodic state snapshots cost a training run: the same steps with and without them,
side by side in one run (issue 39 item 3, state mode; ``steady_bench.py`` is process mode's).

    .venv/bin/python bench/steady_state_bench.py [--size 1] [--intervals 30,10] [--runs 1]
        [--sides none,cairn,dcp_thread,dcp_process] [--smoke] [--dir DIR]

The workload (``steady_state_workload.py``) fine-tunes a model of ``--size`` GiB of state: a
frozen embedding table (90%) under a trainable MLP (10%, plain SGD), so a tenth of the
state's bytes changes between any two snapshots; torch runs each step on every core, so the
snapshots compete with training for them. The count of steps comes from a calibration run
at the start: per interval ``T`` a run lasts about 7.5 ``T`` unhindered, so at least five
snapshots fall inside the steps. Sides, each in a fresh process, the page cache dropped
before each, in rotating order over ``--runs``:

* **none**: the steps alone: the reference;
* **cairn**: ``Checkpointer(every_seconds=T)`` with its defaults (a writer process at
  SCHED_IDLE persists while training goes on; chunks that did not change are not written);
* **dcp_thread**, **dcp_process**: the peer, ``torch.distributed.checkpoint.async_save``
  every T seconds to a fresh directory, the previous one waited for first and removed once
  the next is durable: thread executor with a reused ``DefaultStager`` (the lowest stall in
  ``state_bench``), or the PROCESS executor with shared-memory staging (the upload off the
  training process).

The figure is the step loop's own time (``CLOCK_MONOTONIC``): ``slowdown`` = a side's over
**none**'s (target, cairn: <= 1.03 at 30 s, <= 1.10 at 10 s; the floor is 1.0). Also: the
snapshots started inside the loop, what one snapshot wrote as a share of the state, and
``snap CPU``: the side's CPU (its process and every child it reaped) over **none**'s, as a
share of the loop's time out of the machine's cores. Medians over ``--runs``; the last line
printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchenv import drop_caches, loadavg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(HERE, "steady_state_workload.py")
GIB = 1 << 30
SIDES = ("none", "cairn", "dcp_thread", "dcp_process")
PEERS = ("dcp_thread", "dcp_process")
TARGETS = {30.0: 1.03, 10.0: 1.10}
RUN_INTERVALS = 7.5
CALIBRATION_STEPS = 40


@dataclass(frozen=True)
class Settings:
    size: int
    intervals: tuple[float, ...]
    runs: int
    sides: tuple[str, ...]
    root: str
    python: str


@dataclass(frozen=True)
class SideRun:
    side: str
    steps_s: float
    snapshots: int
    written_bytes: int
    state_bytes: int
    stall_s: float  # the loop's time inside the snapshotting calls
    cpu_s: float  # the side's process and every child it reaped


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_side(s: Settings, side: str, interval: float, steps: int) -> SideRun:
    work = tempfile.mkdtemp(prefix=f"{side}-", dir=s.root)
    result = os.path.join(work, "result.json")
    log = os.path.join(work, "workload.log")
    drop_caches()
    before = children_cpu()
    with open(log, "wb") as out:
        code = subprocess.run([s.python, WORKLOAD, "--bytes", str(s.size), "--steps", str(steps),
                               "--side", side, "--interval", f"{interval:g}", "--dir", work,
                               "--result", result], stdin=subprocess.DEVNULL, stdout=out,
                              stderr=out, check=False).returncode
    cpu = children_cpu() - before
    if code != 0 or not os.path.exists(result):
        text = open(log, encoding="utf-8", errors="replace").read()
        raise RuntimeError(f"the {side} workload exited {code}:\n{text[-3000:]}")
    with open(result, encoding="ascii") as f:
        out = json.load(f)
    shutil.rmtree(work, ignore_errors=True)
    return SideRun(side, out["steps_s"], out["snapshots"], out["written_bytes"],
                   out["state_bytes"], out["stall_s"], cpu)


def calibrate(s: Settings) -> float:
    """Steps per second of the workload alone at the full size (a step's cost depends on the
    trainable part, which scales with it)."""
    run = run_side(s, "none", 1e9, CALIBRATION_STEPS)
    return CALIBRATION_STEPS / run.steps_s


def measure(s: Settings, rate: float) -> list[dict[str, Any]]:
    rows = []
    cores = os.cpu_count() or 1
    for interval in s.intervals:
        steps = max(1, round(rate * interval * RUN_INTERVALS))
        runs: dict[str, list[SideRun]] = {side: [] for side in s.sides}
        for n in range(s.runs):
            order = s.sides[n % len(s.sides):] + s.sides[:n % len(s.sides)]
            for side in order:
                run = run_side(s, side, interval, steps)
                runs[side].append(run)
                print(f"  {interval:g}s run {n + 1} {side}: {run.steps_s:.2f} s, "
                      f"{run.snapshots} snapshots, cpu {run.cpu_s:.1f} s", flush=True)
        base = statistics.median(r.steps_s for r in runs["none"])
        base_cpu = statistics.median(r.cpu_s for r in runs["none"])
        row: dict[str, Any] = {"interval_s": interval, "steps": steps, "none_s": round(base, 3),
                               "state_bytes": runs["none"][0].state_bytes,
                               "target": TARGETS.get(interval)}
        for side in s.sides[1:]:
            med = statistics.median(r.steps_s for r in runs[side])
            cpu = statistics.median(r.cpu_s for r in runs[side]) - base_cpu
            written = statistics.median(r.written_bytes for r in runs[side])
            row[side] = {"steps_s": round(med, 3), "slowdown": round(med / base, 4),
                         "snapshots": min(r.snapshots for r in runs[side]),
                         "stall_s": round(statistics.median(r.stall_s for r in runs[side]), 3),
                         "written_share": round(written / row["state_bytes"], 4),
                         "cpu_share": round(cpu / med / cores, 4)}
            if side == "cairn" and row["target"] is not None:
                row[side]["met"] = row[side]["slowdown"] <= row["target"]
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], sides: tuple[str, ...]) -> None:
    print(f"\n{'interval':>9} {'side':<12} {'steps s':>8} {'slowdown':>9} {'target':>7}       "
          f"{'snaps':>6} {'stall s':>8} {'written':>8} {'snap CPU':>9}")
    for row in rows:
        print(f"{row['interval_s']:>8g}s {'none':<12} {row['none_s']:>8.2f} {1.0:>9.3f}")
        for side in sides[1:]:
            r = row[side]
            target = row["target"] if side == "cairn" else None
            verdict = "" if "met" not in r else ("met" if r["met"] else "MISSED")
            print(f"{'':>9} {side:<12} {r['steps_s']:>8.2f} {r['slowdown']:>9.3f} "
                  f"{target if target else '-':>7} {verdict:<6}{r['snapshots']:>5} "
                  f"{r['stall_s']:>8.2f} {100 * r['written_share']:>7.1f}% "
                  f"{100 * r['cpu_share']:>8.1f}%")
    print("(stall s: the steps' time inside the snapshotting calls, all snapshots together; "
          "written: what one snapshot wrote, as a share of the state (cairn: the median after "
          "its first; DCP: its last checkpoint); snap CPU: the side's CPU over none's, as a "
          "share of its steps' time out of every core; floor: slowdown 1.0)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=float, default=1.0, help="GiB of state (default 1)")
    parser.add_argument("--intervals", default="30,10", help="seconds between snapshots")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="none and any of cairn, dcp_thread, dcp_process")
    parser.add_argument("--smoke", action="store_true",
                        help="32 MiB, a 0.5 s interval, one run: the bench's own test")
    parser.add_argument("--dir", default=None,
                        help="the bench's directory (default: a temp dir on /var/tmp, the disk)")
    args = parser.parse_args()
    sides = tuple(x for x in args.sides.split(",") if x)
    unknown = [x for x in sides if x not in SIDES]
    if unknown or "none" not in sides or len(sides) < 2:
        print(f"--sides: none and at least one of {', '.join(SIDES[1:])} (got "
              f"{args.sides!r})", file=sys.stderr)
        return 2
    sides = ("none", *(x for x in sides if x != "none"))
    size = 32 << 20 if args.smoke else int(args.size * GIB)
    intervals = (0.5,) if args.smoke else tuple(float(x) for x in args.intervals.split(","))
    root = tempfile.mkdtemp(prefix="cairn-steady-state-", dir=args.dir or "/var/tmp")
    s = Settings(size=size, intervals=intervals, runs=1 if args.smoke else max(1, args.runs),
                 sides=sides, root=root, python=sys.executable)
    try:
        started_load = loadavg()
        rate = calibrate(s)
        print(f"workload: {size / GIB:g} GiB of state (10% trainable), {os.cpu_count()} torch "
              f"threads, {rate:.1f} steps/s alone; ~{RUN_INTERVALS} intervals per run",
              flush=True)
        rows = measure(s, rate)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows, sides)
    summary = {"bench": "steady_state", "size_bytes": size, "steps_per_s": round(rate, 2),
               "cores": os.cpu_count(), "load_start": started_load, "load_end": loadavg(),
               "peers": {"dcp_thread": "dcp.async_save every interval, thread executor, a "
                                       "reused DefaultStager, FileSystemWriter defaults",
                         "dcp_process": "dcp.async_save every interval, "
                                        "AsyncCheckpointerType.PROCESS, shared-memory "
                                        "DefaultStager, FileSystemWriter defaults"},
               "floor": 1.0, "rows": rows}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
