"""`make demo-cluster`: a cairn step survives the loss of its node on a multi-worker Airflow.

Starts, under ``.demo/cluster`` (root only): a GCS server process (the bucket every node
shares), PostgreSQL, Redis, the Airflow components (CeleryExecutor) and two Celery workers
standing for two nodes, ``nodeA`` and ``nodeB``, each in namespaces of its own with its own
local disk (``cairn_airflow.local_stack`` with ``executor="celery"``). Triggers
``cairn_cooperative_training``, and once a few snapshots are committed kills the node running
it — every process on it, SIGKILL — and deletes its disk. Airflow notices through the task
heartbeat timeout and retries the task; the retry runs on the other node and resumes from the
last snapshot in the bucket. Then 20 small steps at once (``cairn_fanout_training``, three
worker slots per node) lose a node mid-run: each of its steps resumes on the other node from
its own snapshot, the others complete where they ran. The demo prints what ran where, then
stops everything.
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
    from cairn.store import Key
    from cairn import open_store

    try:
        with open_store(store, create=False) as s:
            return s.snapshots(Key(key))
    except Exception:  # noqa: BLE001 - the first try creates the store
        return []


def outcome_hosts(store: str, key: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(epoch, outcome, the host name that wrote it) per outcome record."""
    from cairn.store import Key
    from cairn import open_store
    from cairn.store.outcomes import outcomes_prefix

    with open_store(store, create=False) as s:
        docs = [json.loads(s.backend.read(i.name))
                for i in s.backend.list(outcomes_prefix(Key(key).path))]
    return [(d["epoch"], d["outcome"], d["writer"]["host"]) for d in docs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-seconds", type=float, default=0.01)
    parser.add_argument("--shards", type=int, default=20,
                        help="concurrent small steps in the second part (0: skip it)")
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
                             executor=Executor.CELERY, worker_concurrency=3, triggerer=False,
                             env={
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
        if state != "success":
            return 1
        return fanout(stack, store, args.shards, root / "fanout", lost.name) if args.shards else 0
    finally:
        say("stopping everything")
        if stack is not None:
            stack.stop()
        gcs.stop()


def fanout(stack: AirflowStack, store: str, shards: int, progress: Path, restart: str) -> int:
    """``shards`` mapped steps at once; the node running the most of them is lost mid-run."""
    dag_id = "cairn_fanout_training"
    stack.restart_node(restart)
    progress.mkdir()
    started = time.monotonic()
    run_id = stack.trigger(dag_id, {"shards": shards, "total_steps": 600, "step_seconds": 0.02,
                                    "progress_dir": str(progress)})
    say(f"triggered {dag_id}: {shards} steps of 600, three worker slots per node")

    def mapped() -> dict[int, dict]:
        doc = stack.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/train/listMapped")
        return {ti["map_index"]: ti for ti in doc["task_instances"]}

    def busy_with_snapshots() -> dict[int, dict] | None:
        running = {i: ti for i, ti in mapped().items() if ti["state"] == "running"}
        with_snaps = [i for i in running
                      if snapshots(store, (dag_id, "train", run_id, str(i)))]
        return running if len(running) >= 2 * 3 and len(with_snaps) == len(running) else None

    running = stack.wait_for(busy_with_snapshots, what="every slot busy past a snapshot",
                             timeout=300, every=1)
    hosts = [ti["hostname"] for ti in running.values()]
    lost = stack.nodes[max(set(hosts), key=hosts.count)]
    on_lost = sorted(i for i, ti in running.items() if ti["hostname"] == lost.name)
    say(f"killing {lost.name}, which runs steps {on_lost}, and deleting its disk")
    lost.kill()
    lost.wipe()
    state = stack.wait_for_run(dag_id, run_id, timeout=900)
    resumed = 0
    for i, ti in sorted(mapped().items()):
        entry = stack.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/train/"
                          f"xcomEntries/return_value?map_index={i}&deserialize=true"
                          "&stringify=false")["value"]
        resumed += entry["start_step"] > 0
        print(f"    step {i:2d}: try {ti['try_number']} on {ti['hostname']}, "
              + (f"resumed at {entry['start_step']}" if entry["start_step"] else "from 0"))
    say(f"run {state} in {time.monotonic() - started:.0f}s: {resumed} of {shards} steps resumed "
        f"on the other node, the rest completed where they ran")
    return 0 if state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
