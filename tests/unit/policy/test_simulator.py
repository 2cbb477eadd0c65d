"""bench/simulate.py's model: it conserves time for every strategy on random traces, replays
traces as documented, and its policy strategy is cairn.policy.decide itself."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cairn.policy
from cairn.exceptions import ConfigError

_PATH = Path(__file__).resolve().parents[3] / "bench" / "simulate.py"
_spec = importlib.util.spec_from_file_location("cairn_bench_simulate", _PATH)
sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sim  # dataclasses look their module up while the class is built
_spec.loader.exec_module(sim)

SPOT, ON_DEMAND = sim.default_options()


@st.composite
def traces(draw: st.DrawFn) -> object:
    period = draw(st.floats(6 * 3600.0, 30 * 24 * 3600.0))
    events = draw(st.lists(st.tuples(
        st.sampled_from([SPOT.name, ON_DEMAND.name]), st.floats(0.0, 0.999999),
        st.sampled_from(["preempt", "preempt", "maintenance"]),
        st.none() | st.floats(0.0, 7200.0)), max_size=40))
    return sim.Trace(tuple(sim.TraceEvent(o, f * period, k, n) for o, f, k, n in events), period)


@st.composite
def step_lists(draw: st.DrawFn) -> list:
    out = []
    for i in range(draw(st.integers(1, 4))):
        cost = draw(st.floats(0.0, 900.0))
        out.append(sim.Step(f"s{i}", draw(st.floats(0.05, 12.0)), cost,
                            draw(st.floats(0.0, 900.0)),
                            draw(st.none() | st.floats(0.1, 30.0)), gpus=draw(st.integers(1, 8))))
    return out


@settings(max_examples=60, deadline=None)
@given(trace=traces(), steps=step_lists(), notice=st.sampled_from([0.0, 15.0, 120.0]),
       restart=st.floats(0.0, 600.0))
def test_every_paid_second_is_useful_wasted_or_overhead(trace, steps, notice, restart) -> None:  # noqa: ANN001
    s = sim.SimSettings(notice_s=notice, restart_s=restart, horizon_factor=5.0, max_tries=60)
    options = sim.default_options(notice_s=notice)
    for strategy, t in sim.run(steps, options, trace, s).items():
        assert t.useful + t.wasted + t.overhead == pytest.approx(t.paid, rel=1e-9, abs=1e-6), \
            strategy
        assert min(t.useful, t.wasted, t.overhead) >= -1e-9
        summary = t.summary()
        assert 0.0 <= summary["goodput"] <= 1.0
        assert summary["cost"] >= 0 and 0 <= summary["deadline_misses"] <= len(steps)
        if t.unfinished == 0:  # each step's work counted as useful exactly once (speed 1.0)
            assert t.useful == pytest.approx(sum(x.work_h * 3600 * x.gpus for x in steps),
                                             rel=1e-6), strategy


def one_step_trace(*events: tuple[str, float, str, float | None]) -> object:
    return sim.Trace(tuple(sim.TraceEvent(*e) for e in events), period_s=1e7)


def test_a_preemption_loses_the_work_since_the_last_snapshot() -> None:
    step = sim.Step("s", work_h=1.0, snapshot_cost_s=60.0, restore_cost_s=90.0)
    replay = sim.Replay(one_step_trace((SPOT.name, 2500.0, "preempt", None)), 0.0, 15.0)
    r = sim.run_try(step, start=0.0, kept_h=0.0, option=SPOT, interval_s=1800.0,
                    snapshot_on_notice=False, replay=replay, avoid_maintenance=False, resume=True)
    assert r.kind.value == "preempted" and r.end == 2500.0
    assert (r.useful, r.overhead, r.wasted) == (1800.0, 60.0, 640.0)
    assert r.kept_h == pytest.approx(0.5)
    # the next try restores, then finishes the other half (one more snapshot on the way)
    nxt = sim.run_try(step, start=2620.0, kept_h=r.kept_h, option=SPOT, interval_s=1000.0,
                      snapshot_on_notice=False, replay=replay, avoid_maintenance=False,
                      resume=True)
    assert nxt.kind.value == "succeeded"
    assert (nxt.useful, nxt.overhead, nxt.wasted) == (1800.0, 90.0 + 60.0, 0.0)


@pytest.mark.parametrize("cost, saved", [(10.0, True), (14.9, True), (20.0, False)])
def test_a_final_snapshot_on_notice_helps_only_when_it_fits(cost: float, saved: bool) -> None:
    step = sim.Step("s", work_h=2.0, snapshot_cost_s=cost, restore_cost_s=cost)
    replay = sim.Replay(one_step_trace((SPOT.name, 3000.0, "preempt", None)), 0.0, 15.0)
    kw = dict(start=0.0, kept_h=0.0, option=SPOT, interval_s=math.inf, replay=replay,
              avoid_maintenance=False, resume=True)
    plain = sim.run_try(step, snapshot_on_notice=False, **kw)
    notice = sim.run_try(step, snapshot_on_notice=True, **kw)
    assert plain.wasted == 3000.0 and plain.kept_h == 0.0
    if saved:
        assert notice.wasted == 0.0 and notice.useful == 3000.0 - 15.0
        assert notice.end == 3000.0 - 15.0 + cost
    else:
        assert (notice.wasted, notice.kept_h) == (plain.wasted, 0.0)


def test_rerun_starts_over_and_announced_maintenance_is_avoided_only_by_the_policy() -> None:
    step = sim.Step("s", work_h=1.0, snapshot_cost_s=30.0, restore_cost_s=30.0)
    trace = one_step_trace((SPOT.name, 1800.0, "maintenance", 7200.0))
    s = sim.SimSettings(restart_s=0.0)
    out = {}
    for strategy in ("rerun", "adaptive", "policy"):
        out[strategy] = sim.simulate_step(step, sim.planner(strategy, [SPOT, ON_DEMAND], s),
                                          sim.Replay(trace, 0.0, 15.0), s, [SPOT, ON_DEMAND])
    # announced 2 h ahead of a try that starts at 0: the policy's pod avoids that node
    assert out["policy"].tries == 1 and out["policy"].wasted == 0.0
    assert out["rerun"].tries == 2 and out["rerun"].wasted == 1800.0
    assert out["adaptive"].tries == 2


def test_the_policy_strategy_is_cairn_policy_decide() -> None:
    assert sim.decide is cairn.policy.decide
    step = sim.Step("s", work_h=3.0, snapshot_cost_s=30.0, restore_cost_s=30.0, deadline_h=3.2)
    plan = sim.planner("policy", [SPOT, ON_DEMAND], sim.SimSettings())
    p = plan(step, cairn.policy.History(), 0.0, 0.0)
    direct = cairn.policy.decide([SPOT, ON_DEMAND], deadline=sim.T0 + 3.2 * 3600, now=sim.T0,
                                 remaining_work_h=3.0)
    assert (p.option, p.interval_s, p.reason) == (direct.option, direct.snapshot_interval_s,
                                                  direct.reason)


def test_replay_wraps_the_period_and_offsets_each_step() -> None:
    trace = sim.Trace((sim.TraceEvent(SPOT.name, 100.0), sim.TraceEvent(SPOT.name, 700.0)),
                      period_s=1000.0)
    replay = sim.Replay(trace, 500.0, 15.0)
    assert replay.next_event(SPOT.name, 0.0)[0] == 200.0      # trace time 700
    assert replay.next_event(SPOT.name, 200.0)[0] == 600.0    # wraps to 1100
    assert replay.next_event(ON_DEMAND.name, 0.0)[0] == math.inf


def test_csv_round_trip_and_errors_name_the_line(tmp_path: Path) -> None:
    trace = sim.read_trace_csv(sim.EXAMPLE_TRACE)
    assert trace.period_s == 14 * 24 * 3600 and len(trace.events) > 50
    copy = tmp_path / "copy.csv"
    sim.write_trace_csv(trace, copy)
    assert sim.read_trace_csv(copy).events == trace.events
    assert trace.source == "bench/traces/example.csv"
    bad = tmp_path / "bad.csv"
    bad.write_text("# c\noption,at_s,event\na,10,preempt\na,20,exploded\n")
    with pytest.raises(ConfigError, match=r"bad.csv:4: event must be one of"):
        sim.read_trace_csv(bad)
    bad.write_text("when,where\n1,2\n")
    with pytest.raises(ConfigError, match="header must name at least option,at_s"):
        sim.read_trace_csv(bad)
    bad.write_text("option,at_s\na,-5\n")
    with pytest.raises(ConfigError, match=":2: at_s must be"):
        sim.read_trace_csv(bad)
