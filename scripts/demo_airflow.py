"""`make demo`: the cooperative training DAG on a real local Airflow, preempted mid-run.

Starts Airflow 3 (api-server, scheduler, dag-processor; LocalExecutor, SQLite) under
``.demo/airflow`` with the ``cairn_default`` connection naming the local store ``.demo/store``,
triggers ``cairn_cooperative_training`` (dags/cooperative_training.py), SIGKILLs the task's
process once a few snapshots are committed — what a spot preemption does to it — and lets
Airflow retry. The retry resumes from the last snapshot; the demo prints how much work that
saved and how to look at the snapshots.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import urllib.parse
from pathlib import Path

from cairn_airflow.local_stack import AirflowStack

REPO = Path(__file__).resolve().parents[1]
DAG_ID = "cairn_cooperative_training"
EVERY_STEPS = 100  # dags/cooperative_training.py


def say(text: str) -> None:
    print(f"\033[1m==> {text}\033[0m", flush=True)


def progress_rows(path: Path) -> list[tuple[int, int, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        pid, step, at = line.split()
        rows.append((int(pid), int(step), float(at)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--step-seconds", type=float, default=0.005)
    parser.add_argument("--kill-after-step", type=int, default=1250)
    parser.add_argument("--dir", default=str(REPO / ".demo"))
    parser.add_argument("--serve", type=int, metavar="PORT", default=None,
                        help="serve the last demo's Airflow (and the snapshots page) on PORT "
                             "until Ctrl-C, instead of running the demo")
    args = parser.parse_args()

    root = Path(args.dir)
    store, progress = root / "store", root / "progress.log"
    if args.serve:
        return serve(root, store, args.serve)
    shutil.rmtree(root, ignore_errors=True)
    stack = AirflowStack(root / "airflow", REPO / "dags", store=store)
    say(f"starting Airflow 3 (LocalExecutor, SQLite) in {stack.home}; logs: {stack.home}/*.log")
    started = time.monotonic()
    stack.start()
    try:
        say(f"Airflow is up at {stack.base} after {time.monotonic() - started:.0f}s; "
            f"triggering {DAG_ID} ({args.steps} steps, a snapshot every {EVERY_STEPS})")
        run_id = stack.trigger(DAG_ID, {"total_steps": args.steps,
                                        "step_seconds": args.step_seconds,
                                        "progress_log": str(progress)})
        stack.wait_for(lambda: (rows := progress_rows(progress)) and rows[-1][1] >= args.kill_after_step,
                       what=f"step {args.kill_after_step}", timeout=300)
        ti = stack.task_instance(DAG_ID, run_id, "train")
        rows = progress_rows(progress)
        say(f"step {rows[-1][1]} reached: SIGKILL to the task's process {ti['pid']} "
            "(what a spot preemption does to it)")
        os.kill(ti["pid"], signal.SIGKILL)
        state = stack.wait_for_run(DAG_ID, run_id, timeout=600)
        if state != "success":
            print(stack.logs_tail(), file=sys.stderr)
            say(f"the run ended {state}")
            return 1
        result = stack.xcom(DAG_ID, run_id, "train")
        meta = stack.xcom(DAG_ID, run_id, "train", "cairn")
        rows = progress_rows(progress)
        first = [r for r in rows if r[0] == rows[0][0]]
        reached = first[-1][1]
        step_s = (first[-1][2] - first[0][2]) / max(1, len(first) - 1)
        start = result["start_step"]
        say(f"try {meta['try_number']} resumed at step {start} (snapshot seq "
            f"{meta['resumed_from']}); the killed try had reached step {reached}")
        print(f"    work saved:  {start} of {args.steps} steps not rerun "
              f"(~{start * step_s:.1f}s of training at {step_s * 1000:.1f} ms/step)")
        print(f"    work redone: {reached - start + 1} steps (at most one snapshot interval, "
              f"{EVERY_STEPS} steps)")
        print(f"    without cairn the retry would have started at step 0 and rerun {reached + 1} "
              "steps")
        say("look at it yourself")
        print(f"    .venv/bin/cairn ls {store}")
        print("    make demo-ui   # then open the URL it prints: this run's snapshots, tries and "
              "their outcomes")
        (root / "last_run.json").write_text(json.dumps({"dag_id": DAG_ID, "run_id": run_id}))
        return 0
    finally:
        stack.stop()


def serve(root: Path, store: Path, port: int) -> int:
    """Start the last demo's Airflow again on ``port`` and wait for Ctrl-C."""
    last = root / "last_run.json"
    if not last.exists():
        print("no demo has run yet: run `make demo` first", file=sys.stderr)
        return 2
    run = json.loads(last.read_text())
    stack = AirflowStack(root / "airflow", REPO / "dags", store=store, port=port)
    stack.start()
    query = urllib.parse.urlencode({"dag_id": run["dag_id"], "task_id": "train",
                                    "run_id": run["run_id"]})
    say(f"Airflow is up: {stack.base}/cairn/snapshots?{query}")
    print("    (the task instance's 'cairn snapshots' tab shows the same page; Ctrl-C stops)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
