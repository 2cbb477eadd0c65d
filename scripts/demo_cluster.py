"""`make demo-cluster`: a cairn step survives the loss of its node on a multi-worker Airflow.

Starts, under ``.demo/cluster`` (root only): a GCS server process (the bucket every node
shares), PostgreSQL, Redis, the Airflow components (CeleryExecutor) and two Celery workers
standing for two nodes, ``nodeA`` and ``nodeB``, each in namespaces of its own with its own
local disk (``cairn_airflow.local_stack`` with ``executor="celery"``). Triggers
``cairn_cooperative_training``, and once a few snapshots are committed kills the node running
it — every process on it, SIGKILL — and deletes its disk. Airflow notices through the task
heartbeat timeout and retries the task; the retry runs on the other node and resumes from the
last snapshot in the bucket. The demo prints what ran where, then stops everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from cairn_airflow.local_services import GcsServer
from cairn_airflow.local_stack import AirflowStack, Executor

REPO = Path(__file__).resolve().parents[1]
DAG_ID = "cairn_cooperative_training"
EVERY_STEPS = 100  # dags/cooperative_training.py
HEARTBEAT_TIMEOUT_S = 10


def say(text: str) -> None:
    print(f"\033[1m==> {text}\033[0m", flush=True)


def progress_rows(path: Path) -> list[tuple[int, int, float]]:
    if not path.exists():
        return []
    return [(int(p), int(s), float(t)) for p, s, t in
            (line.split() for line in path.read_text().splitlines())]


def snapshots(store: str, key: tuple[str, ...]) -> list:  # noqa: ANN001
    from cairn.store import Key, open_store

    try:
        with open_store(store, create=False) as s:
            return s.snapshots(Key(key))
    except Exception:  # noqa: BLE001 - the first try creates the store
        return []


def outcome_hosts(store: str, key: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(epoch, outcome, the host name that wrote it) per outcome record."""
    from cairn.store import Key, open_store
    from cairn.store.outcomes import outcomes_prefix

    with open_store(store, create=False) as s:
        docs = [json.loads(s.backend.read(i.name))
                for i in s.backend.list(outcomes_prefix(Key(key).path))]
    return [(d["epoch"], d["outcome"], d["writer"]["host"]) for d in docs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-seconds", type=float, default=0.01)
    parser.add_argument("--dir", default=str(REPO / ".demo" / "cluster"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("make demo-cluster: the worker nodes need namespaces of their own: run as root",
              file=sys.stderr)
        return 2

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    root.chmod(0o755)
    progress = root / "progress.log"
    gcs = GcsServer()
    stack = None
    try:
        say("starting a GCS server, PostgreSQL, Redis, Airflow (CeleryExecutor) and nodes "
            "nodeA, nodeB")
        gcs.start()
        bucket = f"cairn-demo-{uuid.uuid4().hex[:8]}"
        gcs.create_bucket(bucket)
        os.environ.update(gcs.env)
        store = f"gs://{bucket}/demo"
        stack = AirflowStack(root / "airflow", REPO / "dags", store=store,
                             executor=Executor.CELERY, triggerer=False, env={
                                 **gcs.env,
                                 "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT":
                                     str(HEARTBEAT_TIMEOUT_S)})
        started = time.monotonic()
        stack.start(timeout=300)
        say(f"cluster up in {time.monotonic() - started:.0f}s; the api-server is {stack.base}")

        run_id = stack.trigger(DAG_ID, {"total_steps": args.steps,
                                        "step_seconds": args.step_seconds,
                                        "progress_log": str(progress)})
        key = (DAG_ID, "train", run_id, "-1")
        say(f"triggered {DAG_ID} ({args.steps} steps, a snapshot every {EVERY_STEPS})")
        stack.wait_for(lambda: any((i.manifest.step or 0) >= 3 * EVERY_STEPS
                                   for i in snapshots(store, key)),
                       what="three snapshots", timeout=300)
        ti = stack.task_instance(DAG_ID, run_id, "train")
        lost = stack.nodes[ti["hostname"]]
        reached = progress_rows(progress)[-1][1]
        say(f"try {ti['try_number']} runs on {lost.name}, at step {reached}: killing "
            f"{lost.name} (SIGKILL to every process on it) and deleting its disk")
        lost.kill()
        lost.wipe()
        killed_at = time.monotonic()
        say(f"waiting for Airflow to notice (task_instance_heartbeat_timeout = "
            f"{HEARTBEAT_TIMEOUT_S}s) and retry on the other node")
        state = stack.wait_for_run(DAG_ID, run_id, timeout=300)
        ti = stack.task_instance(DAG_ID, run_id, "train")
        result = stack.xcom(DAG_ID, run_id, "train")
        say(f"run {state} {time.monotonic() - killed_at:.0f}s after the kill: try "
            f"{ti['try_number']} ran on {ti['hostname']} from step {result['start_step']} "
            f"(the first try had reached step {reached}; "
            f"{reached - result['start_step'] + 1} steps redone, "
            f"{result['start_step']} not redone)")
        for epoch, outcome, host in outcome_hosts(store, key):
            print(f"    outcome record of try epoch {epoch}: {outcome}, written on {host}")
        return 0 if state == "success" else 1
    finally:
        say("stopping everything")
        if stack is not None:
            stack.stop()
        gcs.stop()


if __name__ == "__main__":
    sys.exit(main())
