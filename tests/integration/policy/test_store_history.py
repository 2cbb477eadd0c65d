"""The policy and the simulator on a real store: outcome records written through
Store.records.record_outcome become the policy's history and the simulator's trace."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from cairn.policy import CapacityOption, History, PolicySettings, decide
from cairn.store import Key, Store
from cairn import open_store
from cairn.store.outcomes import Outcome, OutcomeKind, Progress
from tests.support.hang import HANG_S

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "simulate.py"
KEY = Key(("dag", "train", "run-1", "0"))
SPOT = CapacityOption.gke_spot("a100-spot", price_per_hour=1.15)
ON_DEMAND = CapacityOption("a100-ondemand", 3.67, compute_class="a100-ondemand",
                           priority_class="training-high")


def load_simulator():  # noqa: ANN201 - the bench module
    spec = importlib.util.spec_from_file_location("cairn_bench_simulate_it", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_try(store: Store, *, outcome: OutcomeKind, option: str, reason: str, start_step: int,
            end_step: int, snap_every: int = 100) -> Outcome:
    """A real try: open an attempt, commit snapshots, then record how it ended."""
    attempt = store.open_attempt(KEY)
    started = _now(store, attempt.epoch)
    kept = start_step
    for step in range(start_step + snap_every, end_step + 1, snap_every):
        with attempt.snapshot() as snap:
            snap.add_bytes("state.bin", step.to_bytes(4, "big") * 256)
            manifest = snap.commit(step=step)
        kept = step
    record = Outcome(epoch=attempt.epoch, outcome=outcome, started_at=started,
                     ended_at=started + 1800.0,
                     progress=Progress(start_step=start_step, end_step=end_step, kept_step=kept,
                                       total_steps=1000,
                                       snapshot_seq=manifest.seq if kept > start_step else None),
                     snapshot_cost_s=12.0, restore_cost_s=20.0 if start_step else None,
                     option=option, reason=reason)
    store.records.record_outcome(KEY, record)
    return record


def _now(store: Store, epoch: int) -> float:
    (open_try,) = [t for t in store.records.tries(KEY) if t.epoch == epoch]
    return open_try.opened_at


def test_third_try_after_two_recorded_preemptions_goes_on_demand(store: Store) -> None:
    s = PolicySettings(max_preemptions=2)
    first = decide([SPOT, ON_DEMAND], History.from_store(store, KEY), settings=s)
    assert first.option == SPOT
    run_try(store, outcome=OutcomeKind.PREEMPTED, option=first.option.name, reason=first.reason,
            start_step=0, end_step=320)
    second = decide([SPOT, ON_DEMAND], History.from_store(store, KEY), settings=s)
    assert second.option == SPOT
    run_try(store, outcome=OutcomeKind.PREEMPTED, option=second.option.name,
            reason=second.reason, start_step=300, end_step=650)
    history = History.from_store(store, KEY)
    assert [o.reason for o in history.outcomes] == [first.reason, second.reason]
    assert history.kept_step() == 600 and len(history.tries) == 2
    third = decide([SPOT, ON_DEMAND], history, settings=s)
    assert third.option == ON_DEMAND
    assert "2 preemptions >= K=2" in third.reason
    assert "no outcome record" not in third.reason
    assert third.pod_fields() == {
        "nodeSelector": {"cloud.google.com/compute-class": "a100-ondemand"},
        "priorityClassName": "training-high",
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "cloud.google.com/scheduled-maintenance-time",
                 "operator": "DoesNotExist"}]}]}}},
    }
    assert third.env()["CAIRN_PLACEMENT_REASON"] == third.reason


def test_a_try_killed_before_recording_its_outcome_is_named_not_guessed(store: Store) -> None:
    run_try(store, outcome=OutcomeKind.PREEMPTED, option="a100-spot", reason="r1",
            start_step=0, end_step=150)
    store.open_attempt(KEY)  # SIGKILLed with no notice: nobody wrote its outcome
    history = History.from_store(store, KEY)
    assert history.unrecorded_tries() == [history.tries[-1].epoch]
    p = decide([SPOT, ON_DEMAND], history, settings=PolicySettings(max_preemptions=2))
    assert p.option == SPOT
    assert "1 earlier tries have no outcome record (not counted)" in p.reason


def test_a_store_exports_its_preemptions_as_a_trace_and_the_cli_replays_it(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    with open_store(url) as store:
        a = run_try(store, outcome=OutcomeKind.PREEMPTED, option="a100-spot", reason="r1",
                    start_step=0, end_step=250)
        b = run_try(store, outcome=OutcomeKind.EVICTED, option="a100-spot", reason="r2",
                    start_step=200, end_step=420)
        run_try(store, outcome=OutcomeKind.SUCCEEDED, option="a100-ondemand", reason="r3",
                start_step=400, end_step=1000)
    sim = load_simulator()
    trace = sim.trace_from_store(url, [str(KEY)])
    assert [(e.option, e.kind) for e in trace.events] == [("a100-spot", "preempt"),
                                                          ("a100-spot", "maintenance")]
    assert [e.at_s for e in trace.events] == [a.ended_at - a.started_at,
                                              b.ended_at - a.started_at]
    proc = subprocess.run([sys.executable, str(BENCH), "--from-store", url, "--key", str(KEY),
                           "--sweep", "none", "--no-plot", "--steps", "3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    assert f"trace: store {url} (2 events, 1 spot preemptions" in proc.stdout
    assert set(json.loads(proc.stdout.strip().splitlines()[-1])["strategies"]) == {
        "rerun", "fixed", "adaptive", "adaptive_notice", "policy"}
    empty = subprocess.run([sys.executable, str(BENCH), "--from-store", url, "--key", "nope",
                            "--sweep", "none", "--no-plot"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert empty.returncode == 2 and "no preemptions or evictions recorded" in empty.stderr
