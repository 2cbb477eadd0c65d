"""The final snapshot as a preempted user waits for it: from the stop signal to a durable
snapshot, against plain CRIU's dump to disk and an fsync of its images, side by side.

    sudo .venv/bin/python bench/final_bench.py [--size 2] [--runs 3] [--interval 10]
        [--cases first,consecutive] [--smoke] [--dir DIR]

The workload (``steady_workload.py``, one thread) holds ``--size`` GiB of random bytes and
runs CPU-bound steps that rewrite 10% of its pages every ``--interval`` seconds at its
unhindered speed (calibrated at the start), for longer than any side needs. Cases:

* **first**: the final snapshot is the try's first (``--every`` far beyond the run): a
  preemption before any periodic snapshot, every page written;
* **consecutive**: ``--every INTERVAL``; the stop comes 40% of an interval after the second
  periodic snapshot committed, so the final one dedups against it (about 4% of the pages
  changed since, as in a step preempted between snapshots).

Sides, in rotating order, each in a fresh workload, page cache synced and dropped before the
stop:

* **plain**: ``criu dump -t PID -D DIR -o dump.log --manage-cgroups=ignore --ghost-limit
  512M`` (no ``--leave-running``: a final dump ends the process) into a fresh directory on the
  bench's disk, then every image file and the directory ``fsync``ed: its start to the last
  fsync's return. The dump needs only the workload's own state, so plain has one figure per
  case: its images are the whole process each time (CRIU writes every page);
* **cairn**: ``cairn run --store DIR --key K --every T --grace 300s -- python
  steady_workload.py ...`` (the installed CLI, a local store on the same disk, staging where
  its policy puts it), SIGTERM sent to it: the signal to the moment its log says ``final
  snapshot seq N committed`` (the commit has returned: durable). Also read from that line:
  what the final snapshot took inside ``cairn run`` and what its budget expected
  (``expected``, the figure a final snapshot is allowed or refused by).

Figures: ``durable`` (medians), ``ratio`` = cairn / plain (target <= 1.3 at 2 GiB),
``expected`` / ``took`` (target: within 20%), plain's dump and fsync parts, the image's bytes,
and the floor: the image written with 4 MiB writes and fsynced on this disk (``floor``,
measured once). The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchenv import BenchError, drop_caches, fsync_path, loadavg, read, remove, wait_for  # noqa: E402,E501

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(HERE, "steady_workload.py")
VENV_BIN = os.path.join(os.path.dirname(HERE), ".venv", "bin")
GIB = 1 << 30
CASES = ("first", "consecutive")
SIDES = ("plain", "cairn")
TARGET_RATIO = 1.3
TARGET_ESTIMATE = 0.20
CHANGED_PER_INTERVAL = 0.10
STOP_AFTER_COMMIT = 0.4  # of an interval: between two periodic snapshots
CALIBRATION_STEPS = 3000
COMMITTED = re.compile(r"snapshot seq \d+ committed")
FINAL = re.compile(r"final snapshot seq (\d+) committed in ([0-9.]+)s"
                   r"(?: \(expected ([0-9.]+)s: ([^)]*)\))?")
PREEMPTED_SAVED = 75


@dataclass(frozen=True)
class Settings:
    size: int
    interval: float
    runs: int
    cases: tuple[str, ...]
    root: str
    criu: str
    cairn: str
    python: str
    timeout_s: float


def _death_signal() -> None:
    # SIGKILL when the bench dies, so a crashed or timed-out bench leaves nothing running.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def workload_argv(s: Settings, pages_per_step: float, result: str) -> list[str]:
    return [s.python, WORKLOAD, "--bytes", str(s.size), "--steps", str(10 ** 9),
            "--pages-per-step", f"{pages_per_step:.6f}", "--result", result]


def calibrate(s: Settings) -> float:
    """Steps per second of the workload alone, from a short run at 64 MiB."""
    result = os.path.join(s.root, "calibrate.json")
    argv = [s.python, WORKLOAD, "--bytes", str(64 << 20), "--steps", str(CALIBRATION_STEPS),
            "--pages-per-step", "0", "--result", result]
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
    with open(result, encoding="ascii") as f:
        return CALIBRATION_STEPS / json.load(f)["steps_s"]


def workload_pid(tag: str) -> int | None:
    """The PID of the workload whose command line holds ``tag`` (its result path)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        # The workload itself (python WORKLOAD ...), not `cairn run`, whose command line
        # holds the same words after its `--`.
        if len(argv) > 1 and argv[1] == WORKLOAD.encode() and tag.encode() in argv:
            return int(name)
    return None


def resident(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def filled(s: Settings, tag: str) -> int | None:
    """The workload's PID once it holds its whole buffer."""
    pid = workload_pid(tag)
    return pid if pid is not None and resident(pid) >= s.size else None


def kill_tree(tag: str, proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    pid = workload_pid(tag)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def image_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def plain_side(s: Settings, case: str, pages_per_step: float) -> dict[str, Any]:
    """The workload alone, then ``criu dump`` (ending it) and an fsync of every image."""
    result = os.path.join(s.root, f"result-{uuid.uuid4().hex[:8]}.json")
    log = open(os.path.join(s.root, "plain-workload.log"), "ab")
    proc = subprocess.Popen(workload_argv(s, pages_per_step, result), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, start_new_session=True,
                            preexec_fn=_death_signal)
    images = tempfile.mkdtemp(prefix="plain-", dir=s.root)
    try:
        wait_for(lambda: filled(s, result) or proc.poll() is not None, s.timeout_s,
                 "the workload's buffer")
        if proc.poll() is not None:
            raise BenchError(f"the workload exited {proc.returncode}")
        # As long after the fill as cairn's consecutive case runs before its stop.
        time.sleep(1.0 if case == "first" else (2 + STOP_AFTER_COMMIT) * s.interval)
        drop_caches()
        started = time.monotonic()
        done = subprocess.run([s.criu, "dump", "-t", str(proc.pid), "-D", images, "-o",
                               "dump.log", "--manage-cgroups=ignore", "--ghost-limit", "512M"],
                              stdin=subprocess.DEVNULL, capture_output=True)
        dumped = time.monotonic()
        if done.returncode != 0:
            raise BenchError(f"criu dump failed: {read(os.path.join(images, 'dump.log'))[-2000:]}")
        for name in os.listdir(images):
            fsync_path(os.path.join(images, name))
        fsync_path(images, directory=True)
        ended = time.monotonic()
        return {"durable_s": ended - started, "dump_s": dumped - started,
                "fsync_s": ended - dumped, "image_bytes": image_bytes(images)}
    finally:
        kill_tree(result, proc)
        log.close()
        shutil.rmtree(images, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(result)


def cairn_side(s: Settings, case: str, pages_per_step: float) -> dict[str, Any]:
    """``cairn run`` until the case's moment, SIGTERM, until the final commit is logged."""
    result = os.path.join(s.root, f"result-{uuid.uuid4().hex[:8]}.json")
    store = os.path.join(s.root, f"store-{uuid.uuid4().hex[:8]}")
    every = "100000s" if case == "first" else f"{s.interval:g}s"
    argv = [s.cairn, "run", "--store", store, "--key", f"final/{case}/{uuid.uuid4().hex[:8]}",
            "--every", every, "--grace", "300s",
            "--workdir", os.path.join(s.root, f"work-{uuid.uuid4().hex[:8]}"), "--",
            *workload_argv(s, pages_per_step, result)]
    log_path = os.path.join(s.root, f"cairn-{uuid.uuid4().hex[:8]}.log")
    log = open(log_path, "ab")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True, preexec_fn=_death_signal)
    try:
        wait_for(lambda: filled(s, result) or proc.poll() is not None, s.timeout_s,
                 "the workload's buffer under cairn run")
        if case == "first":
            time.sleep(1.0)
        else:
            wait_for(lambda: len(COMMITTED.findall(read(log_path))) >= 2
                     or proc.poll() is not None, s.timeout_s, "two periodic snapshots")
            time.sleep(STOP_AFTER_COMMIT * s.interval)
        if proc.poll() is not None:
            raise BenchError(f"cairn run exited {proc.returncode}:\n{read(log_path)[-3000:]}")
        before = len(COMMITTED.findall(read(log_path)))
        drop_caches()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        found = wait_for(lambda: FINAL.search(read(log_path)) or proc.poll() is not None,
                         s.timeout_s, "the final snapshot's commit", poll_s=0.005)
        durable = time.monotonic() - started
        if not isinstance(found, re.Match):
            raise BenchError(f"cairn run exited {proc.returncode} without a final snapshot:\n"
                             f"{read(log_path)[-3000:]}")
        code = proc.wait(timeout=s.timeout_s)
        if code != PREEMPTED_SAVED:
            raise BenchError(f"cairn run exited {code}, not {PREEMPTED_SAVED}:\n"
                             f"{read(log_path)[-3000:]}")
        text = read(log_path)
        committed = COMMITTED.findall(text)
        last = re.findall(r"snapshot seq \d+ committed: .*?image ([0-9.]+) MB, written "
                          r"([0-9.]+) MB.*?dump ([0-9.]+)s \+ ingest ([0-9.]+)s", text)
        image_mb, written_mb, dump_s, ingest_s = (float(x) for x in last[-1])
        return {"durable_s": durable, "took_s": float(found.group(2)),
                "expected_s": float(found.group(3)) if found.group(3) else None,
                "basis": found.group(4), "periodic": before, "snapshots": len(committed),
                "dump_s": dump_s, "ingest_s": ingest_s, "image_bytes": int(image_mb * 1e6),
                "written_bytes": int(written_mb * 1e6)}
    finally:
        kill_tree(result, proc)
        log.close()
        for path in (store, log_path):
            remove(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(result)


def floor_s(s: Settings, size: int) -> float:
    """``size`` bytes written with 4 MiB writes to a fresh file on the bench's disk, fsynced."""
    path = os.path.join(s.root, "floor.bin")
    block = os.urandom(4 << 20)
    drop_caches()
    started = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(block[:min(left, len(block))])
        os.fsync(f.fileno())
    fsync_path(s.root, directory=True)
    took = time.monotonic() - started
    os.unlink(path)
    return took


def med(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def summarize(case: str, runs: list[dict[str, dict[str, Any]]], floor: float
              ) -> dict[str, Any]:
    plain = med([r["plain"]["durable_s"] for r in runs])
    cairn = med([r["cairn"]["durable_s"] for r in runs])
    errors = [abs(r["cairn"]["expected_s"] - r["cairn"]["took_s"]) / r["cairn"]["took_s"]
              for r in runs if r["cairn"]["expected_s"] is not None and r["cairn"]["took_s"]]
    ratio = cairn / plain if plain and cairn else None
    worst = max(errors) if errors else None
    return {
        "case": case, "plain_s": plain, "cairn_s": cairn, "ratio": ratio,
        "plain_dump_s": med([r["plain"]["dump_s"] for r in runs]),
        "plain_fsync_s": med([r["plain"]["fsync_s"] for r in runs]),
        "cairn_took_s": med([r["cairn"]["took_s"] for r in runs]),
        "cairn_dump_s": med([r["cairn"]["dump_s"] for r in runs]),
        "cairn_ingest_s": med([r["cairn"]["ingest_s"] for r in runs]),
        "expected_s": med([r["cairn"]["expected_s"] for r in runs]),
        "estimate_error_worst": worst,
        "basis": runs[-1]["cairn"]["basis"],
        "image_bytes": med([r["plain"]["image_bytes"] for r in runs]),
        "written_bytes": med([r["cairn"]["written_bytes"] for r in runs]),
        "floor_s": floor,
        "targets_met": {"ratio": ratio is not None and ratio <= TARGET_RATIO,
                        "estimate": worst is not None and worst <= TARGET_ESTIMATE},
    }


def measure(s: Settings, rate: float) -> list[dict[str, Any]]:
    pages = s.size // os.sysconf("SC_PAGE_SIZE")
    pages_per_step = CHANGED_PER_INTERVAL * pages / (rate * s.interval)
    floor = floor_s(s, s.size)
    rows = []
    for c, case in enumerate(s.cases):
        runs: list[dict[str, dict[str, Any]]] = []
        for n in range(s.runs):
            order = SIDES if (n + c) % 2 == 0 else SIDES[::-1]
            run: dict[str, dict[str, Any]] = {}
            for side in order:
                side_fn = plain_side if side == "plain" else cairn_side
                run[side] = side_fn(s, case, pages_per_step)
                extra = "" if side == "plain" else \
                    f" (took {run[side]['took_s']:.2f}s, expected {run[side]['expected_s']}s)"
                print(f"  {case} run {n + 1} {side}: durable after "
                      f"{run[side]['durable_s']:.2f}s{extra}", flush=True)
            runs.append(run)
        rows.append({**summarize(case, runs, floor), "runs": runs})
    return rows


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(s: Settings, rows: list[dict[str, Any]]) -> None:
    print(f"\nfinal snapshot, {s.size / GIB:g} GiB, page cache dropped before each stop; "
          f"medians of {s.runs}")
    print(f"{'case':<12} {'plain':>6} {'cairn':>6} {'ratio':>6} {'<=1.3':<6} {'p.dump':>6} "
          f"{'p.sync':>6} {'c.took':>6} {'c.dump':>6} {'ingest':>6} {'expect':>6} "
          f"{'err':>5} {'<=20%':<6} {'floor':>6} {'image':>7} {'written':>7}")
    for r in rows:
        met = r["targets_met"]
        print(f"{r['case']:<12} {fmt(r['plain_s']):>6} {fmt(r['cairn_s']):>6} "
              f"{fmt(r['ratio']):>6} {'met' if met['ratio'] else 'MISSED':<6} "
              f"{fmt(r['plain_dump_s']):>6} {fmt(r['plain_fsync_s']):>6} "
              f"{fmt(r['cairn_took_s']):>6} {fmt(r['cairn_dump_s']):>6} "
              f"{fmt(r['cairn_ingest_s']):>6} {fmt(r['expected_s']):>6} "
              f"{fmt(None if r['estimate_error_worst'] is None else 100 * r['estimate_error_worst'], '.0f'):>4}% "
              f"{'met' if met['estimate'] else 'MISSED':<6} {fmt(r['floor_s']):>6} "
              f"{r['image_bytes'] / 1e6:>6.0f}M {r['written_bytes'] / 1e6:>6.0f}M")
    print("columns (seconds): plain = criu dump + fsync of every image and the directory; "
          "cairn = SIGTERM to cairn run until its log says the final snapshot committed; "
          "ratio = cairn/plain (target <= 1.3); p.dump/p.sync = plain's parts; c.took = the "
          "final snapshot inside cairn run (dump + ingest), c.dump/ingest its parts; expect = "
          "what its budget expected; err = the worst |expect - took| / took of the runs "
          "(target <= 20%); floor = the image's size written in 4 MiB writes + fsync; "
          "image = plain's images; written = what cairn's final snapshot added to the store")
    for r in rows:
        print(f"  {r['case']}: the budget's basis: {r['basis']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=float, default=2.0, help="GiB held (default 2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--interval", type=float, default=10.0,
                        help="seconds between periodic snapshots (consecutive case)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--smoke", action="store_true",
                        help="64 MiB, a 1 s interval, one run: the bench's own test")
    parser.add_argument("--dir", default=None,
                        help="the bench's directory (default: a temp dir on /var/tmp, the disk)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    criu = shutil.which("criu", path="/usr/local/sbin:/usr/sbin:/usr/bin")
    cairn = os.path.join(VENV_BIN, "cairn")
    if os.geteuid() != 0 or criu is None or not os.path.exists(cairn):
        print("needs root, criu (make criu) and .venv's cairn (make venv)", file=sys.stderr)
        return 2
    cases = tuple(c for c in args.cases.split(",") if c)
    if not cases or any(c not in CASES for c in cases):
        print(f"--cases: pick from {', '.join(CASES)}", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="cairn-final-", dir=args.dir or "/var/tmp")
    s = Settings(size=64 << 20 if args.smoke else int(args.size * GIB),
                 interval=1.0 if args.smoke else args.interval,
                 runs=1 if args.smoke else args.runs, cases=cases, root=root, criu=criu,
                 cairn=cairn, python=sys.executable, timeout_s=300.0)
    load_start = loadavg()
    try:
        rate = calibrate(s)
        print(f"workload: {s.size / GIB:g} GiB, {rate:.0f} steps/s alone, 10% of the pages "
              f"rewritten per {s.interval:g}s", flush=True)
        rows = measure(s, rate)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(s, rows)
    summary = {"bench": "final", "settings": {k: v for k, v in asdict(s).items()
                                              if k != "root"},
               "peer": "criu dump -t PID -D DIR -o dump.log --manage-cgroups=ignore "
                       "--ghost-limit 512M, then fsync of every image and of DIR",
               "targets": {"ratio": TARGET_RATIO, "estimate_error": TARGET_ESTIMATE},
               "load_start": load_start, "load_end": loadavg(), "rows": rows}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
