"""cairn's share of the downtime of a move: from ``cairn resume --placement`` to the first
training step of the try on the new capacity option (issue 19 item 4), for a state-mode step
or, with ``--process``, a process under ``cairn run``.

    .venv-airflow/bin/python bench/move_bench.py [--state-gb 1.5] [--poll 5] [--dir /var/tmp]
    .venv-airflow/bin/python bench/move_bench.py --process [--process-gib 1]   # as root (CRIU)

One run, real processes, a local store: a training try (``bench/move_workload.py``, placed
on the spot option by ``cairn.policy.decide``) is suspended by a suspend request and ends with
its final snapshot (exit 77); then, timed from the resume request that names the on-demand
option:

* **trigger**: the real ``CairnResumeTrigger.run()`` (the deferred task's trigger, polling
  the store every ``--poll`` seconds, 5 s by default as in the operator), started
  ``--resume-after`` seconds before the resume is asked for, until it fires: on average half
  a poll, at most one;
* **placement**: ``cairn.policy.place_as_asked`` over the step's history (what the pod
  operator's continuation does to build the new pod) and its environment;
* **restore**: the new try's process (with that environment, as the new pod's main
  container) started until ``Checkpointer.restore`` returned, every chunk verified;
* **first step**: until its first training step ended. In process mode ``cairn run`` restores
  the tree (eager, verified) and the restored process's next step is the first line it appends
  to its metrics file: one figure for both.

Not in these figures, because nothing here can run them: the Airflow scheduler queueing the
continuation and a worker starting it (measured in ADR 0027), Kubernetes scheduling the pod
onto a node of the new option (provisioning one, when none is free), pulling the image there,
and reading the snapshot from GCS instead of a local disk. The page cache is dropped before the
restore (as root; else the output says it was warm).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEY = "bench_dag/train/manual__move/-1"


class StateTry:
    """A state-mode try: ``move_workload.py`` (a Checkpointer), its lines on stdout."""

    def __init__(self, store: str, extra_env: dict[str, str], args: argparse.Namespace,
                 tmp: Path) -> None:
        env = {**os.environ, **extra_env, "CAIRN_SUSPEND_POLL": "0.5s"}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "move_workload.py"), store, KEY,
             "--state-gb", str(args.state_gb)], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)

    def wait_for(self, prefix: str) -> float:
        """The time stamp of the process's next line starting with ``prefix``."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return float(line.split()[2])
        raise SystemExit(f"the workload ended (rc {self.proc.wait()}) before {prefix!r}")


class ProcessTry(StateTry):
    """A process-mode try: ``cairn run`` around ``move_process_workload.py``; its steps are
    lines of a metrics file the workload appends to (a restored process goes on writing it)."""

    def __init__(self, store: str, extra_env: dict[str, str], args: argparse.Namespace,
                 tmp: Path) -> None:
        env = {**os.environ, **extra_env, "CAIRN_SUSPEND_POLL": "0.5s"}
        self.metrics = tmp / "metrics.txt"
        self.metrics.touch()
        self.seen = len(self.metrics.read_text().splitlines())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cairn.cli.main", "run", "--store", store, "--key", KEY,
             "--every", "0", "--grace", "120s", "--workdir", str(tmp / "run"), "--no-echo",
             "--", sys.executable, str(HERE / "move_process_workload.py"),
             "--bytes", str(int(args.process_gib * (1 << 30))), "--metrics",
             str(self.metrics)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=tmp)

    def wait_for(self, prefix: str) -> float:
        while True:
            lines = self.metrics.read_text().splitlines()
            for line in lines[self.seen:]:
                self.seen += 1
                if line.startswith(prefix):
                    return float(line.split()[2])
            if self.proc.poll() is not None:
                raise SystemExit(f"cairn run ended (rc {self.proc.returncode}) before "
                                 f"{prefix!r}:\n{self.proc.stdout.read() if self.proc.stdout else ''}")
            time.sleep(0.01)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-gb", type=float, default=1.5)
    parser.add_argument("--process", action="store_true",
                        help="process mode: `cairn run` (CRIU; root) around a process of "
                             "--process-gib of memory, instead of a state-mode torch try")
    parser.add_argument("--process-gib", type=float, default=1.0)
    parser.add_argument("--poll", type=float, default=5.0)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--resume-after", type=float, default=12.3,
                        help="seconds the trigger polls before the resume is asked for (its "
                             "phase against the poll decides the trigger's share)")
    args = parser.parse_args()

    from cairn.policy import CapacityOption, History, decide, place_as_asked
    from cairn.store import Key
    from cairn import open_store
    from cairn_airflow.triggers import CairnResumeTrigger

    spot = CapacityOption.gke_spot("l4-spot", price_per_hour=0.35)
    on_demand = CapacityOption("l4-on-demand", price_per_hour=1.05,
                               node_selector={"cloud.google.com/gke-provisioning": "standard"})
    key = Key.parse(KEY)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="cairn-move-") as tmp:
        store_url = str(Path(tmp) / "store")
        first = decide([spot, on_demand])
        kind = ProcessTry if args.process else StateTry
        running = kind(store_url, first.env(), args, Path(tmp))
        running.wait_for("step 2 ")
        with open_store(store_url) as store:
            asked = store.records.request_suspend(key, by="bench", reason="move")
        out = running.proc.communicate(timeout=600)[0]
        if running.proc.returncode != 77:
            raise SystemExit(f"the first try ended {running.proc.returncode}, not 77:\n{out}")
        suspended_s = time.time() - asked.at
        with open_store(store_url) as store:
            state_bytes = store.snapshots(key)[0].manifest.bytes_logical  # process: the image
        trigger = CairnResumeTrigger(store_url=store_url, key=KEY, epoch=asked.epoch,
                                     poll_seconds=args.poll)
        resumed_at: list[float] = []

        def resume() -> None:  # the operator, while the trigger has been polling for a while
            with open_store(store_url) as store:
                resumed_at.append(time.time())
                store.records.request_resume(key, by="bench", placement=on_demand.name)

        async def first_event() -> dict:
            loop = asyncio.get_running_loop()
            loop.call_later(args.resume_after, lambda: loop.run_in_executor(None, resume))
            async for event in trigger.run():
                return event.payload
            raise SystemExit("the trigger ended without an event")

        event = asyncio.run(first_event())
        t1 = time.time()
        t0 = resumed_at[0]
        with open_store(store_url) as store:
            history = History.from_store(store, key)
        moved = place_as_asked([spot, on_demand], on_demand.name, by="bench", history=history)
        cold = drop_caches()
        t2 = time.time()
        moving = kind(store_url, moved.env(), args, Path(tmp))
        if args.process:  # cairn run restores the tree; the next line is its next step
            built = restored = t2
        else:
            built = moving.wait_for("built ")
            restored = moving.wait_for("start ")
        stepped = moving.wait_for("step ")
        steady = moving.wait_for("step ") - stepped
        moving.proc.terminate() if args.process else moving.proc.kill()
        moving.proc.communicate(timeout=300)
        with open_store(store_url) as store:
            outcomes = store.records.outcomes(key)
        rows = [("trigger fires", t1 - t0), ("placement", t2 - t1)]
        if args.process:
            rows += [("cairn run: restore + first step", stepped - t2)]
        else:
            rows += [("process start, model built", built - t2),
                     ("restore (verified)", restored - built), ("first step", stepped - restored)]
        rows += [("total (cairn's share)", stepped - t0), ("(the next step, for scale)", steady)]
        load = os.getloadavg()[0]
        what = "process image" if args.process else "state"
        print(f"load average {load:.2f} on {os.cpu_count()} CPUs; "
              f"{what} {state_bytes / 1e9:.2f} GB, trigger poll {args.poll:g} s, "
              f"{'cold' if cold else 'WARM'} page cache before the restore; suspend request "
              f"-> exit 77 (final snapshot) {suspended_s:.2f} s")
        print(f"{'part':32} {'seconds':>8}")
        for name, seconds in rows:
            print(f"{name:32} {seconds:8.2f}")
        print(json.dumps({"mode": "process" if args.process else "state",
                          "load_average": load, "state_bytes": state_bytes, "poll_s": args.poll, "cold": cold,
                          "event": event["status"], "suspend_s": round(suspended_s, 3),
                          "parts": {n: round(s, 3) for n, s in rows},
                          "suspended_outcome_option": outcomes[0].option,
                          "placement_reason": moved.reason}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
