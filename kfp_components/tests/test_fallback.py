"""``with_fallback``: the spot task with retries, then an on-demand task on the same key.

The compiled spec is checked as YAML; the behaviour runs under kfp.local (SubprocessRunner on
this interpreter: real processes, real torch, a real local store). kfp.local ignores the
kfp-kubernetes placement, so "spot" and "on-demand" differ there only in the outcome records.
"""

# No `from __future__ import annotations`: kfp reads a pipeline's annotations as objects.

import json
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from kfp import compiler, dsl, local
from kfp.dsl import pipeline_context

import cairn_kfp
import kfp_workloads
from cairn.exceptions import ConfigError, Preempted
from cairn.policy import CapacityOption, History
from cairn.store import Key
from cairn import open_store
from cairn.store.outcomes import OutcomeKind
from cairn.store.slotlog import RecordKind
from cairn_kfp._runtime import _cairn_result_name, _cairn_run

# kfp.local does not apply display names (nor any kfp-kubernetes setting).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Task .* settings \\['display_name'\\] have no effect")

STEPS, EVERY = 12, 3
SPOT = CapacityOption.gke_spot("l4-spot", price_per_hour=0.3)
ON_DEMAND = CapacityOption("l4", price_per_hour=1.0, compute_class="l4-on-demand")


@cairn_kfp.component(base_image="python:3.11", every_steps=EVERY, persist="inline")
def fit(steps: int, failing_tries: int, log: str, ckpt) -> dict:
    """Train ``steps`` steps. The first ``failing_tries`` tries (counted in ``log``) end four
    steps after where they started: the first by SIGKILL (a reclaim without notice), later ones
    by an error. ``log`` gets ``start N KEY`` per try."""
    import os
    import signal

    import kfp_workloads

    tries = 0
    if os.path.exists(log):
        with open(log) as f:
            tries = sum(1 for line in f if line.startswith("start "))
    model, opt = kfp_workloads._model()
    start = ckpt.restore(model=model, optimizer=opt)
    with open(log, "a") as f:
        f.write(f"start {start} {os.environ['CAIRN_KEY']}\n")
    for step in range(start, steps):
        kfp_workloads._train_step(model, opt, step)
        ckpt.step(step)
        if tries < failing_tries and step == start + 4:
            if tries == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("spot node lost")
    return {"weight": model.weight.flatten().tolist(), "bias": model.bias.tolist(),
            "start": start}


def _starts(log: Path) -> list[tuple[int, str]]:
    return [(int(parts[1]), parts[2]) for parts in map(str.split, log.read_text().splitlines())]


# -- the compiled pattern -------------------------------------------------------------------


def _compile(pipeline, tmp_path: Path) -> dict:
    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    return list(yaml.safe_load_all(path.read_text()))


def test_the_pattern_compiles_to_two_tasks_on_one_key(tmp_path: Path) -> None:
    @dsl.pipeline
    def p(store: str = "/s") -> dict:
        tasks = cairn_kfp.with_fallback(fit, spot=SPOT, on_demand=ON_DEMAND, spot_retries=4,
                                        backoff="30s", steps=STEPS, failing_tries=0, log="/l",
                                        cairn_store=store)
        return tasks.fallback.output

    spec, platform = _compile(p, tmp_path)
    tasks = spec["root"]["dag"]["tasks"]
    assert sorted(tasks) == ["fit", "fit-2"]
    spot, fallback = tasks["fit"], tasks["fit-2"]
    for task in (spot, fallback):
        params = task["inputs"]["parameters"]
        assert params["cairn_task_name"]["runtimeValue"]["constant"] == "fit"  # shared key
        assert params["cairn_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
        options = params["cairn_options"]["runtimeValue"]["constant"]
        assert options["share_result"] is True and options["every_steps"] == EVERY
    containers = spec["deploymentSpec"]["executors"]
    for task, option in ((spot, "l4-spot"), (fallback, "l4")):
        env = {e["name"]: e["value"] for e in containers[
            task["componentRef"]["name"].replace("comp-", "exec-")]["container"]["env"]}
        assert env["CAIRN_PLACEMENT_OPTION"] == option
        assert env["CAIRN_PLACEMENT_REASON"].startswith(option + ": ")
    assert spot["retryPolicy"]["maxRetryCount"] == 4
    assert spot["retryPolicy"]["backoffDuration"] == "30s"
    assert "retryPolicy" not in fallback
    assert fallback["dependentTasks"] == ["fit"]
    assert fallback["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert "triggerPolicy" not in spot
    assert spec["root"]["outputDefinitions"]["parameters"]["Output"]
    assert spec["root"]["dag"]["outputs"]["parameters"]["Output"]["valueFromParameter"][
        "producerSubtask"] == "fit-2"

    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    on_spot = executors[spot["componentRef"]["name"].replace("comp-", "exec-")]
    on_demand = executors[fallback["componentRef"]["name"].replace("comp-", "exec-")]
    assert on_spot["nodeSelector"]["labels"] == {"cloud.google.com/gke-spot": "true"}
    assert on_spot["tolerations"] == [{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                                       "value": "true", "effect": "NoSchedule"}]
    assert on_demand["nodeSelector"]["labels"] == {"cloud.google.com/compute-class":
                                                   "l4-on-demand"}
    assert "tolerations" not in on_demand


def test_defaults_place_spot_by_gke_label_and_leave_the_fallback_unplaced(
        tmp_path: Path) -> None:
    @dsl.pipeline
    def p() -> None:
        cairn_kfp.with_fallback(fit, cairn_key="team/exp-1/fit", avoid_maintenance=True,
                                steps=1, failing_tries=0, log="/l", cairn_store="/s")

    spec, platform = _compile(p, tmp_path)
    tasks = spec["root"]["dag"]["tasks"]
    for task in tasks.values():
        params = task["inputs"]["parameters"]
        assert params["cairn_key"]["runtimeValue"]["constant"] == "team/exp-1/fit"
        assert "cairn_task_name" not in params or \
            params["cairn_task_name"]["runtimeValue"]["constant"] != "fit"
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    spot = executors[tasks["fit"]["componentRef"]["name"].replace("comp-", "exec-")]
    fallback = executors[tasks["fit-2"]["componentRef"]["name"].replace("comp-", "exec-")]
    assert spot["nodeSelector"]["labels"] == {"cloud.google.com/gke-spot": "true"}
    assert "nodeSelector" not in fallback and "tolerations" not in fallback
    maintenance = [{"key": "cloud.google.com/scheduled-maintenance-time",
                    "operator": "DoesNotExist"}]
    for executor in (spot, fallback):
        assert executor["nodeAffinity"] == [{"matchExpressions": maintenance}]


@dsl.component(base_image="python:3.11")
def plain(x: int) -> int:
    return x


@cairn_kfp.component(base_image="python:3.11")
def writes_artifact(out: dsl.Output[dsl.Dataset], ckpt) -> None:
    pass


@pytest.mark.parametrize(("call", "match"), [
    (lambda: cairn_kfp.with_fallback(plain, x=1), "made by @cairn_kfp.component"),
    (lambda: cairn_kfp.with_fallback(writes_artifact), r"\['out'\] are artifacts"),
    (lambda: cairn_kfp.with_fallback(fit, spot=ON_DEMAND), "spot=True"),
    (lambda: cairn_kfp.with_fallback(fit, on_demand=SPOT), "spot=False"),
    (lambda: cairn_kfp.with_fallback(
        fit, on_demand=CapacityOption("x", 1.0, priority_class="high"), steps=1,
        failing_tries=0, log="/l"), "priority class"),
    (lambda: cairn_kfp.with_fallback(fit, steps=plain(x=1).output, failing_tries=0, log="/l"),
     "input 'steps' comes from task 'plain' and has no default"),
])
def test_bad_input_is_refused_with_the_fix(call, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        with pipeline_context.Pipeline("p"):
            call()


# -- the result handed on, per run -----------------------------------------------------------


class Pair(NamedTuple):
    a: int
    b: str


def test_a_shared_result_is_reused_within_its_run_only(tmp_path: Path) -> None:
    store, calls = str(tmp_path / "store"), []

    def work() -> Pair:
        calls.append(1)
        return Pair(len(calls), "x")

    options = {"share_result": True}
    assert _cairn_run(work, {}, None, store=store, key="k/f", options=options,
                      run_id="run-1") == Pair(1, "x")
    again = _cairn_run(work, {}, None, store=store, key="k/f", options=options, run_id="run-1")
    assert again == (1, "x") and len(calls) == 1  # not called: the run's result came back
    assert _cairn_run(work, {}, None, store=store, key="k/f", options=options,
                      run_id="run-2") == (2, "x")
    with pytest.raises(ConfigError, match="needs the run id"):
        _cairn_run(work, {}, None, store=store, key="k/f", options=options)


def test_a_try_records_its_own_outcome_with_the_placement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: a Preempted as the Checkpointer raises it after a notice (in a pod,
    PreemptedExit: the script exits 75 once the outcome is recorded)."""
    store = str(tmp_path / "store")
    monkeypatch.setenv("CAIRN_PLACEMENT_OPTION", "l4-spot")
    monkeypatch.setenv("CAIRN_PLACEMENT_REASON", "l4-spot: spot first")

    def preempted(ckpt) -> None:
        model, opt = kfp_workloads._model()
        for step in range(ckpt.restore(model=model, optimizer=opt), 5):
            kfp_workloads._train_step(model, opt, step)
            ckpt.step(step)
        raise Preempted("SIGTERM received; final snapshot seq 5 holds step 4", seq=5)

    with pytest.raises(Preempted):
        _cairn_run(preempted, {}, "ckpt", store=store, key="r/fit", run_id="r",
                   options={"every_steps": 1, "persist": "inline"})
    with open_store(store) as opened:
        [outcome] = opened.records.outcomes(Key.parse("r/fit"))
    assert outcome.outcome is OutcomeKind.PREEMPTED and outcome.option == "l4-spot"
    assert outcome.reason == "l4-spot: spot first"
    assert outcome.progress.start_step == 0 and outcome.progress.kept_step == 4
    assert History(outcomes=(outcome,)).preemptions() == 1


# -- under kfp.local ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_fallback_resumes_from_the_spot_tasks_snapshot(local_kfp: Path,
                                                           tmp_path: Path) -> None:
    store_url, log = str(tmp_path / "store"), tmp_path / "fit.log"
    # The spot task fails on both of its tries; kfp.local then reports the run failed.
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(local_kfp),
               raise_on_error=False)

    @dsl.pipeline
    def training(store: str) -> None:
        cairn_kfp.with_fallback(fit, spot=SPOT, on_demand=ON_DEMAND, spot_retries=1,
                                backoff="0s", steps=STEPS, failing_tries=2, log=str(log),
                                cairn_store=store)

    training(store=store_url)

    tries = _starts(log)
    # Snapshots every 3 steps (after steps 2, 5, 8, 11). Try 1 (spot) is killed after step 4:
    # kept 2. Try 2 (spot retry) fails after step 7: kept 5. Try 3 (the fallback) resumes.
    assert [start for start, _ in tries] == [0, 3, 6]
    assert len({key for _, key in tries}) == 1  # one key for both tasks
    key = Key.parse(tries[0][1])
    assert key.components[1] == "fit"

    [fallback_out] = local_kfp.glob("*/fit-2/executor_output.json")
    result = json.loads(fallback_out.read_text())["parameterValues"]["Output"]
    expected = kfp_workloads.reference(STEPS)
    assert result["start"] == 6
    assert result["weight"] == expected["weight"] and result["bias"] == expected["bias"]

    with open_store(store_url) as store:
        records = store.history(key)
        outcomes = store.records.outcomes(key)
        history = History.from_store(store, key)
    assert records[-1].kind is RecordKind.DONE
    epochs = [r.epoch for r in records if r.kind is RecordKind.OPEN]
    assert len(epochs) == 3
    # The SIGKILLed try recorded nothing; the failed one and the fallback did.
    assert [(o.epoch, o.outcome, o.option) for o in outcomes] == [
        (epochs[1], OutcomeKind.FAILED, "l4-spot"), (epochs[2], OutcomeKind.SUCCEEDED, "l4")]
    failed, succeeded = outcomes
    assert failed.progress.start_step == 3 and failed.progress.kept_step == 5
    assert "spot node lost" in failed.detail["error"]
    assert failed.reason.startswith("l4-spot: spot first")
    assert succeeded.progress.start_step == 6 and succeeded.progress.kept_step == STEPS - 1
    assert succeeded.reason.startswith("l4: on-demand fallback")
    assert history.unrecorded_tries() == [epochs[0]]


@pytest.mark.slow
def test_when_the_spot_task_finishes_the_fallback_hands_on_its_result(
        local_kfp: Path, tmp_path: Path) -> None:
    store_url, log = str(tmp_path / "store"), tmp_path / "fit.log"

    @dsl.pipeline
    def training(store: str) -> dict:
        spot, fallback = cairn_kfp.with_fallback(fit, steps=STEPS, failing_tries=0,
                                                 log=str(log), cairn_store=store)
        return fallback.output

    out = training(store=store_url).output

    [(start, key_text)] = _starts(log)  # the fallback never called the function
    assert start == 0 and out["start"] == 0
    expected = kfp_workloads.reference(STEPS)
    assert out["weight"] == expected["weight"] and out["bias"] == expected["bias"]
    key = Key.parse(key_text)
    with open_store(store_url) as store:
        records = store.history(key)
        outcomes = store.records.outcomes(key)
        kept = json.loads(store.backend.read(_cairn_result_name(str(key), key.components[0])))
    assert [r.kind for r in records].count(RecordKind.OPEN) == 1  # no second attempt
    assert records[-1].kind is RecordKind.DONE
    assert [(o.outcome, o.option) for o in outcomes] == [(OutcomeKind.SUCCEEDED, "gke-spot")]
    assert kept["value"] == out
