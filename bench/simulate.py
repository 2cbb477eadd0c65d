"""Trace-driven simulator: where and how often resumable steps snapshot, compared side by side.

Replays a preemption trace over a set of steps and capacity options and runs five strategies
on exactly the same trace, step by step:

=================  ==========================================================================
``rerun``          spot only, no snapshots: a retry starts from the beginning (what Airflow and
                   KFP do today)
``fixed``          spot only, a snapshot every ``--fixed-interval`` seconds
``adaptive``       spot only, the Young-Daly interval of :func:`cairn.policy.estimate_option`
                   from the snapshot cost and the preemptions the step has seen
``adaptive_notice`` adaptive, plus a final snapshot on the preemption notice -- only when the
                   snapshot cost fits the notice window (an input: ``--notice-s``)
``policy``         :func:`cairn.policy.decide` before every try (the real code, not a copy):
                   option (failover to on-demand after K preemptions or when the deadline is at
                   risk), interval, final snapshot on notice, avoiding announced maintenance
=================  ==========================================================================

Reported per strategy: **goodput** (useful GPU-hours / paid GPU-hours), **cost** (paid hours x
price), **deadline misses** (steps finished after their deadline or not within the horizon) and
**wasted GPU-hours**. Every paid second is exactly one of: useful (work that a later snapshot or
the finish kept), overhead (restores, committed snapshots) or wasted (work lost to an
interruption, an interrupted snapshot or restore, and all work of a step that never finished).

Trace sources: the shipped example (default, ``bench/traces/example.csv``; format in
``bench/traces/FORMAT.md``), ``--trace FILE``, ``--synthetic-rate R`` (Poisson preemptions, R
per hour on the spot option), or ``--from-store URL --key K`` (the preemptions recorded in a
cairn store's outcome records). Each step replays the trace from its own offset (step i of n
starts at i/n of the trace's period, wrapping around), so steps see different stretches.

Model assumptions (all inputs): an interrupted try's next try starts ``--restart-s`` after the
interruption and nothing is paid in between (a try that stopped early after its final snapshot
stops paying then); a try resuming from a snapshot pays the restore cost; a snapshot stalls work
for its cost; a final snapshot on notice starts when the notice comes (an announced maintenance
is worked up to 2 x cost + 60 s before it); on-demand capacity sees only the trace's
maintenance events; a step that has not finished within ``horizon_factor`` x max(work,
deadline) or ``max_tries`` tries counts as unfinished. Prices default to illustrative GCP-like
A100 figures, not quotes.

Output: a table, a sensitivity sweep (preemption rate x snapshot cost x notice window) of
goodput and cost, a PNG plot (``--plot``), and as the last line a JSON object
``{"strategies": {name: {"goodput", "cost", "deadline_misses", "wasted_gpu_hours"}}, ...}``.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cairn.exceptions import ConfigError
from cairn.policy import CapacityOption, History, PolicySettings, decide, estimate_option
from cairn.store.outcomes import Outcome, OutcomeKind, Progress

HERE = Path(__file__).resolve().parent
EXAMPLE_TRACE = HERE / "traces" / "example.csv"
STRATEGIES = ("rerun", "fixed", "adaptive", "adaptive_notice", "policy")
EVENTS = ("preempt", "maintenance")
T0 = 1_800_000_000.0  # simulated clock origin (seconds since the epoch), for outcome records
STEPS_PER_HOUR = 1000  # reference-machine pace of every simulated step (a unit, not a claim)


# -- traces ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEvent:
    """At ``at_s`` seconds into the trace, capacity ``option`` ends the try running on it.

    ``kind``: ``preempt`` (a spot reclaim) or ``maintenance`` (announced ahead; a placement
    that avoids announced maintenance is not hit). ``notice_s``: the warning the pod gets;
    None means the simulation's notice window for preemptions.
    """

    option: str
    at_s: float
    kind: str = "preempt"
    notice_s: float | None = None


@dataclass(frozen=True)
class Trace:
    events: tuple[TraceEvent, ...]
    period_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.period_s > 0:
            raise ConfigError("a trace's period must be > 0 seconds")
        for e in self.events:
            if not 0 <= e.at_s < self.period_s:
                raise ConfigError(f"trace event at {e.at_s} s is outside the period "
                                  f"[0, {self.period_s}) s")
        object.__setattr__(self, "events", tuple(sorted(self.events, key=lambda e: e.at_s)))

    def by_option(self) -> dict[str, list[TraceEvent]]:
        out: dict[str, list[TraceEvent]] = {}
        for e in self.events:
            out.setdefault(e.option, []).append(e)
        return out


def read_trace_csv(path: str | Path) -> Trace:
    """Parse the CSV format of ``bench/traces/FORMAT.md``; ConfigError naming the bad line."""
    path = Path(path)
    period = None
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read trace {path}: {e.strerror}; give a CSV file "
                          "(format: bench/traces/FORMAT.md)") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            name, sep, value = stripped[1:].partition(":")
            if sep and name.strip() == "period_s":
                try:
                    period = float(value)
                except ValueError:
                    raise ConfigError(f"{path}:{number}: period_s must be a number") from None
            continue
        if stripped:
            lines.append((number, line))
    reader = csv.DictReader([line for _, line in lines])
    required = {"option", "at_s"}
    if reader.fieldnames is None or not required <= set(reader.fieldnames):
        raise ConfigError(f"{path}: the header must name at least option,at_s "
                          "(optional: event,notice_s); see bench/traces/FORMAT.md")
    for (number, _), row in zip(lines[1:], reader):
        try:
            kind = (row.get("event") or "preempt").strip()
            if kind not in EVENTS:
                raise ValueError(f"event must be one of {', '.join(EVENTS)}, not {kind!r}")
            notice = (row.get("notice_s") or "").strip()
            option = (row["option"] or "").strip()
            if not option:
                raise ValueError("option is empty")
            at_s = float(row["at_s"])
            if not math.isfinite(at_s) or at_s < 0:
                raise ValueError("at_s must be a number of seconds >= 0")
            rows.append(TraceEvent(option, at_s, kind, float(notice) if notice else None))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{path}:{number}: {e}") from None
    if not rows:
        raise ConfigError(f"{path}: no events; a trace needs at least one row")
    if period is None:
        last = max(e.at_s for e in rows)
        period = last + last / len(rows)  # one mean gap after the last event
    try:
        source = str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        source = str(path)
    return Trace(tuple(rows), period, source=source)


def write_trace_csv(trace: Trace, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(f"# cairn preemption trace (bench/traces/FORMAT.md)\n# period_s: {trace.period_s!r}\n")
        writer = csv.writer(f)
        writer.writerow(["option", "at_s", "event", "notice_s"])
        for e in trace.events:
            writer.writerow([e.option, repr(e.at_s), e.kind,
                             "" if e.notice_s is None else repr(e.notice_s)])


def synthetic_trace(*, rates_per_h: dict[str, float], period_h: float, seed: int,
                    maintenance_per_h: dict[str, float] | None = None,
                    maintenance_notice_s: float = 3600.0) -> Trace:
    """Poisson preemptions at ``rates_per_h[option]`` per hour (plus announced maintenance)."""
    rng = random.Random(seed)
    events = []
    period_s = period_h * 3600.0
    for kind, rates in (("preempt", rates_per_h), ("maintenance", maintenance_per_h or {})):
        for option, rate in sorted(rates.items()):
            if rate <= 0:
                continue
            t = rng.expovariate(rate / 3600.0)
            while t < period_s:
                events.append(TraceEvent(option, t, kind,
                                         maintenance_notice_s if kind == "maintenance" else None))
                t += rng.expovariate(rate / 3600.0)
    return Trace(tuple(events), period_s, source=f"synthetic {rates_per_h} seed {seed}")


def trace_rows_from_outcomes(outcomes: Iterable[Outcome]) -> list[TraceEvent]:
    """The interruptions in outcome records as trace events, timed from the first try's start.

    Only what was observed: preemptions and evictions of tries that recorded their option.
    Stretches when the step was not running say nothing, so the trace under-counts them.
    """
    outcomes = list(outcomes)
    if not outcomes:
        return []
    t0 = min(o.started_at for o in outcomes)
    return [TraceEvent(o.option, o.ended_at - t0,
                       "preempt" if o.outcome is OutcomeKind.PREEMPTED else "maintenance")
            for o in outcomes if o.outcome.interrupted and o.option]


def trace_from_store(url: str, keys: Sequence[str] | None = None) -> Trace:
    """A trace of the interruptions recorded in a cairn store (all keys, or ``keys``).

    Each key's events are timed from that key's first try; the period spans the longest key's
    recorded history.
    """
    from cairn.store import Key
    from cairn import open_store

    events: list[TraceEvent] = []
    span = 0.0
    with open_store(url, create=False) as store:
        chosen = [Key.parse(k) for k in keys] if keys else store.keys()
        for key in chosen:
            outcomes = store.records.outcomes(key)
            if not outcomes:
                continue
            events += trace_rows_from_outcomes(outcomes)
            span = max(span, max(o.ended_at for o in outcomes) - min(o.started_at for o in outcomes))
    if not events:
        raise ConfigError(f"no preemptions or evictions recorded in {url}"
                          f"{' for ' + ', '.join(keys) if keys else ''}; record outcomes with "
                          "Store.record_outcome, or use --trace / --synthetic-rate")
    return Trace(tuple(events), max(span, max(e.at_s for e in events)) + 1.0,
                 source=f"store {url}")


# -- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """A step to run: ``work_h`` hours on the reference machine (speed 1.0), its measured
    snapshot and restore costs, an optional deadline (hours from its start), GPUs per try."""

    name: str
    work_h: float
    snapshot_cost_s: float
    restore_cost_s: float
    deadline_h: float | None = None
    gpus: int = 1

    @property
    def total_steps(self) -> int:
        return max(1, round(self.work_h * STEPS_PER_HOUR))


@dataclass(frozen=True)
class SimSettings:
    restart_s: float = 120.0
    fixed_interval_s: float = 1800.0
    notice_s: float = 15.0
    horizon_factor: float = 20.0
    max_tries: int = 300
    policy: PolicySettings = PolicySettings()


@dataclass
class Totals:
    """Seconds (GPU-seconds when multiplied by the step's GPUs) by where they went."""

    paid: float = 0.0
    useful: float = 0.0
    wasted: float = 0.0
    overhead: float = 0.0
    cost: float = 0.0
    deadline_misses: int = 0
    unfinished: int = 0
    tries: int = 0
    on_demand_tries: int = 0

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict[str, float | int]:
        return {"goodput": round(self.useful / self.paid, 4) if self.paid else 0.0,
                "cost": round(self.cost, 2),
                "deadline_misses": self.deadline_misses,
                "wasted_gpu_hours": round(self.wasted / 3600.0, 2)}


@dataclass
class TryResult:
    end: float
    kind: OutcomeKind
    useful: float = 0.0     # work whose progress this try kept (committed or finished)
    wasted: float = 0.0
    overhead: float = 0.0
    kept_h: float = 0.0     # reference hours of work kept at the end of the try
    end_h: float = 0.0      # reference hours reached in memory when it ended
    snapshots: int = 0
    free_at: float = 0.0    # when the next try may start (the interruption, or the end)


class Replay:
    """The trace seen from one step's offset: the next event on an option after a time."""

    def __init__(self, trace: Trace, offset_s: float, notice_s: float) -> None:
        self.period = trace.period_s
        self.offset = offset_s
        self.notice_s = notice_s
        self.events = trace.by_option()
        self.times = {o: [e.at_s for e in es] for o, es in self.events.items()}

    def next_event(self, option: str, after_s: float, *, skip_announced_before: float | None = None
                   ) -> tuple[float, str, float]:
        """(sim time, kind, notice) of the first event on ``option`` strictly after
        ``after_s``; maintenance announced by ``skip_announced_before`` is skipped (the try
        was placed off that node). ``inf`` when the option has no events."""
        times = self.times.get(option)
        if not times:
            return math.inf, "none", 0.0
        x = self.offset + after_s
        cycle = math.floor(x / self.period)
        idx = bisect.bisect_right(times, x - cycle * self.period)
        for _ in range(len(times) + 1):
            if idx == len(times):
                cycle, idx = cycle + 1, 0
            event = self.events[option][idx]
            at = cycle * self.period + event.at_s - self.offset
            notice = self.notice_s if event.notice_s is None else event.notice_s
            if (event.kind == "maintenance" and skip_announced_before is not None
                    and at - notice <= skip_announced_before):
                idx += 1
                continue
            return at, event.kind, notice
        return math.inf, "none", 0.0  # every event was avoided


def run_try(step: Step, *, start: float, kept_h: float, option: CapacityOption,
            interval_s: float, snapshot_on_notice: bool, replay: Replay,
            avoid_maintenance: bool, resume: bool) -> TryResult:
    """One try from ``start`` until it finishes or the trace interrupts it (see the module
    docstring for what each second counts as). A try that stops after its final snapshot
    stops paying then; its node is gone at the event (``free_at``)."""
    cost = step.snapshot_cost_s
    speed = option.relative_speed
    event_at, kind, notice = replay.next_event(
        option.name, start, skip_announced_before=start if avoid_maintenance else None)
    interrupted = OutcomeKind.PREEMPTED if kind == "preempt" else OutcomeKind.EVICTED
    final_fits = snapshot_on_notice and cost <= notice
    # The final snapshot starts when the notice comes (or when the try starts, if it came
    # before); a long notice (announced maintenance) is used to keep working until a margin
    # of 2 x cost + 60 s before the event.
    final_at = max(event_at - notice, event_at - (2 * cost + 60.0))
    if not resume:
        kept_h = 0.0
    r = TryResult(end=start, kind=OutcomeKind.SUCCEEDED, kept_h=kept_h, end_h=kept_h,
                  free_at=start)

    def stop(at: float) -> TryResult:
        r.end, r.kind, r.free_at = at, interrupted, max(event_at, at)
        return r

    t = start
    if resume and kept_h > 0:
        if event_at <= t + step.restore_cost_s:
            r.wasted += event_at - t
            return stop(event_at)
        r.overhead += step.restore_cost_s
        t += step.restore_cost_s
    remaining = (step.work_h - kept_h) * 3600.0 / speed  # seconds of compute left
    pending = 0.0  # work done since the last commit
    while True:
        segment = min(interval_s, remaining)
        final_start = max(final_at, t)
        if final_fits and final_start < t + segment and final_start + cost <= event_at:
            pending += final_start - t
            t = final_start
            if pending > 0:  # the final snapshot keeps what was done since the last one
                r.overhead += cost
                t += cost
                r.snapshots += 1
                r.useful += pending
                r.kept_h += pending * speed / 3600.0
            r.end_h = r.kept_h
            return stop(t)
        if event_at < t + segment:
            pending += event_at - t
            r.wasted += pending
            r.end_h = r.kept_h + pending * speed / 3600.0
            return stop(event_at)
        t += segment
        pending += segment
        remaining -= segment
        if remaining <= 1e-9:
            r.useful += pending
            r.kept_h = r.end_h = step.work_h
            r.end = r.free_at = t
            return r
        if event_at < t + cost:  # interrupted mid-snapshot: the snapshot and the work are lost
            r.wasted += pending + (event_at - t)
            r.end_h = r.kept_h + pending * speed / 3600.0
            return stop(event_at)
        r.overhead += cost
        t += cost
        r.snapshots += 1
        r.useful += pending
        r.kept_h += pending * speed / 3600.0
        r.end_h = r.kept_h
        pending = 0.0
        if final_fits and final_at <= t:  # the notice came during that snapshot: stop now
            return stop(t)


@dataclass(frozen=True)
class TryPlan:
    option: CapacityOption
    interval_s: float
    snapshot_on_notice: bool
    avoid_maintenance: bool
    resume: bool
    reason: str


Planner = Callable[[Step, History, float, float], TryPlan]


def planner(strategy: str, options: Sequence[CapacityOption], sim: SimSettings) -> Planner:
    """How ``strategy`` places each try: (step, history, sim time, kept hours) -> plan."""
    spot = min((o for o in options if o.spot), key=lambda o: o.price_per_work, default=None)
    if spot is None:
        raise ConfigError("the simulation needs a spot option to compare strategies on")

    def adaptive_interval(history: History) -> float:
        return estimate_option(spot, history, remaining_work_h=None,
                               settings=sim.policy).interval_s

    if strategy == "rerun":
        return lambda step, h, now, kept: TryPlan(spot, math.inf, False, False, False, "rerun")
    if strategy == "fixed":
        return lambda step, h, now, kept: TryPlan(spot, sim.fixed_interval_s, False, False, True,
                                                  "fixed")
    if strategy == "adaptive":
        return lambda step, h, now, kept: TryPlan(spot, adaptive_interval(h), False, False, True,
                                                  "adaptive")
    if strategy == "adaptive_notice":
        return lambda step, h, now, kept: TryPlan(spot, adaptive_interval(h), True, False, True,
                                                  "adaptive+notice")
    if strategy == "policy":
        def place(step: Step, history: History, now: float, kept_h: float) -> TryPlan:
            speeds = {o.name: o.relative_speed for o in options}
            remaining = history.remaining_work_h(speeds)
            if remaining is None:  # first try: the step declares its length and pace
                remaining = step.work_h - kept_h
            deadline = None if step.deadline_h is None else T0 + step.deadline_h * 3600.0
            p = decide(options, history, deadline=deadline, now=T0 + now,
                       remaining_work_h=remaining, settings=sim.policy)
            # The runtime takes a final snapshot whenever its measured cost fits the time left
            # (cairn.state.triggers), so the try is notice-aware whatever the estimate said.
            return TryPlan(p.option, p.snapshot_interval_s, True, p.avoid_maintenance, True,
                           p.reason)
        return place
    raise ConfigError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")


def simulate_step(step: Step, plan: Planner, replay: Replay, sim: SimSettings,
                  options: Sequence[CapacityOption]) -> Totals:
    """Run one step to completion (or the horizon) under one strategy."""
    by_name = {o.name: o for o in options}
    horizon = sim.horizon_factor * max(step.work_h, step.deadline_h or 0.0) * 3600.0
    totals = Totals()
    history = History()
    now, kept_h, epoch = 0.0, 0.0, 0
    finished_at = None
    measured_cost: float | None = None
    while now < horizon and epoch < sim.max_tries:
        epoch += 1
        p = plan(step, history, now, kept_h)
        option = by_name[p.option.name]
        start_h = kept_h if p.resume else 0.0
        r = run_try(step, start=now, kept_h=kept_h, option=option, interval_s=p.interval_s,
                    snapshot_on_notice=p.snapshot_on_notice, replay=replay,
                    avoid_maintenance=p.avoid_maintenance, resume=p.resume)
        paid = r.end - now
        totals.tries += 1
        totals.on_demand_tries += not option.spot
        totals.paid += paid * step.gpus
        totals.useful += r.useful * step.gpus
        totals.wasted += r.wasted * step.gpus
        totals.overhead += r.overhead * step.gpus
        totals.cost += paid / 3600.0 * option.price_per_hour * step.gpus
        if r.snapshots:
            measured_cost = step.snapshot_cost_s
        history = history.with_outcome(Outcome(
            epoch=epoch, outcome=r.kind, started_at=T0 + now, ended_at=T0 + r.end,
            progress=Progress(start_step=_steps(start_h), end_step=_steps(r.end_h),
                              kept_step=_steps(r.kept_h), total_steps=step.total_steps),
            snapshot_cost_s=measured_cost,
            restore_cost_s=step.restore_cost_s if p.resume and start_h > 0 else None,
            option=option.name, reason=p.reason))
        kept_h = r.kept_h
        if r.kind is OutcomeKind.SUCCEEDED:
            finished_at = r.end
            break
        now = r.free_at + sim.restart_s
    if finished_at is None:
        # Never finished: whatever it kept was paid for nothing.
        totals.wasted += totals.useful
        totals.useful = 0.0
        totals.unfinished += 1
    if finished_at is None or (step.deadline_h is not None
                               and finished_at > step.deadline_h * 3600.0):
        totals.deadline_misses += 1
    return totals


def _steps(hours: float) -> int:
    return max(0, round(hours * STEPS_PER_HOUR))


def run(steps: Sequence[Step], options: Sequence[CapacityOption], trace: Trace,
        sim: SimSettings, strategies: Sequence[str] = STRATEGIES) -> dict[str, Totals]:
    """Every strategy over every step, on the same replays."""
    out = {}
    for strategy in strategies:
        plan = planner(strategy, options, sim)
        totals = Totals()
        for i, step in enumerate(steps):
            replay = Replay(trace, trace.period_s * i / len(steps), sim.notice_s)
            totals.add(simulate_step(step, plan, replay, sim, options))
        out[strategy] = totals
    return out


# -- defaults ---------------------------------------------------------------------------------


def default_options(*, spot_name: str = "a100-spot", on_demand_name: str = "a100-ondemand",
                    notice_s: float = 15.0) -> tuple[CapacityOption, ...]:
    """Illustrative GCP-like prices for one A100 40GB (USD/h; not a quote)."""
    return (
        CapacityOption.gke_spot(spot_name, price_per_hour=1.15, notice_s=notice_s),
        CapacityOption(on_demand_name, price_per_hour=3.67, compute_class="a100-ondemand"),
    )


def default_steps(n: int = 12, *, seed: int = 7, snapshot_cost_s: float | None = None
                  ) -> list[Step]:
    """A mixed set: 1-10 h of work, snapshot cost 10/45/180 s (restore 1.5x), deadlines from
    1.3x to 3x the work (some none), 1 or 8 GPUs."""
    rng = random.Random(seed)
    steps = []
    for i in range(n):
        work = rng.choice((1.0, 2.0, 4.0, 6.0, 10.0))
        cost = snapshot_cost_s if snapshot_cost_s is not None else rng.choice((10.0, 45.0, 180.0))
        slack = rng.choice((1.3, 1.6, 2.0, 3.0, None))
        steps.append(Step(f"step-{i}", work, cost, cost * 1.5,
                          None if slack is None else round(work * slack, 2),
                          gpus=rng.choice((1, 1, 8))))
    return steps


# -- output -----------------------------------------------------------------------------------


def table(results: dict[str, Totals]) -> str:
    head = (f"{'strategy':<16}{'goodput':>8}{'cost $':>10}{'vs rerun':>9}{'misses':>7}"
            f"{'wasted GPU-h':>13}{'overhead GPU-h':>15}{'paid GPU-h':>11}{'tries':>6}{'on-dem':>7}")
    lines = [head, "-" * len(head)]
    base = results.get("rerun")
    for name, t in results.items():
        s = t.summary()
        ratio = f"{t.cost / base.cost:.2f}" if base and base.cost else "-"
        lines.append(f"{name:<16}{s['goodput']:>8.3f}{s['cost']:>10.2f}{ratio:>9}"
                     f"{s['deadline_misses']:>7}{s['wasted_gpu_hours']:>13.2f}"
                     f"{t.overhead / 3600:>15.2f}{t.paid / 3600:>11.2f}{t.tries:>6}"
                     f"{t.on_demand_tries:>7}")
    return "\n".join(lines)


def sweep(rates: Sequence[float], costs: Sequence[float], notices: Sequence[float], *,
          n_steps: int, seed: int, sim: SimSettings, spot_name: str, on_demand_name: str
          ) -> list[dict[str, Any]]:
    """Synthetic traces at each preemption rate, every step with the given snapshot cost,
    every notice window: each cell runs all strategies."""
    rows = []
    for rate in rates:
        trace = synthetic_trace(rates_per_h={spot_name: rate}, period_h=24 * 30, seed=seed,
                                maintenance_per_h={on_demand_name: 1 / 720})
        for cost in costs:
            steps = default_steps(n_steps, seed=seed, snapshot_cost_s=cost)
            for notice in notices:
                options = default_options(spot_name=spot_name, on_demand_name=on_demand_name,
                                          notice_s=notice)
                cell_sim = replace(sim, notice_s=notice)
                res = run(steps, options, trace, cell_sim)
                rows.append({"rate_per_h": rate, "snapshot_cost_s": cost, "notice_s": notice,
                             **{name: t.summary() for name, t in res.items()}})
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'rate/h':>7}{'snap s':>7}{'notice s':>9} | "
            + "".join(f"{s[:9]:>10}" for s in STRATEGIES) + " | policy cost vs rerun, misses")
    lines = ["goodput by strategy", head, "-" * len(head)]
    for row in rows:
        base = row["rerun"]["cost"]
        ratio = f"{row['policy']['cost'] / base:.2f}" if base else "-"
        lines.append(f"{row['rate_per_h']:>7g}{row['snapshot_cost_s']:>7g}{row['notice_s']:>9g} | "
                     + "".join(f"{row[s]['goodput']:>10.3f}" for s in STRATEGIES)
                     + f" | {ratio:>5}, {row['policy']['deadline_misses']} vs "
                     f"{row['rerun']['deadline_misses']}")
    return "\n".join(lines)


def plot(results: dict[str, Totals], rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = list(results)
    summaries = [results[n].summary() for n in names]
    axes[0].bar(names, [s["goodput"] for s in summaries], color="tab:green")
    axes[0].set_title("goodput (useful / paid GPU-h)")
    axes[0].set_ylim(0, 1)
    axes[1].bar(names, [s["cost"] for s in summaries], color="tab:blue")
    axes[1].set_title("cost ($), with deadline misses")
    for i, s in enumerate(summaries):
        axes[1].annotate(f"{s['deadline_misses']} missed", (i, s["cost"]), ha="center",
                         va="bottom", fontsize=8)
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    if rows:
        for strategy in STRATEGIES:
            axes[2].plot(range(len(rows)), [r[strategy]["goodput"] for r in rows], marker=".",
                         label=strategy)
        axes[2].set_xticks(range(len(rows)))
        axes[2].set_xticklabels([f"{r['rate_per_h']:g}/{r['snapshot_cost_s']:g}/"
                                 f"{r['notice_s']:g}" for r in rows], rotation=90, fontsize=6)
        axes[2].set_title("sweep goodput (rate per h / snapshot s / notice s)")
        axes[2].legend(fontsize=7)
    fig.suptitle(f"simulated: {title}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, default=EXAMPLE_TRACE,
                     help="preemption trace CSV (default: the shipped example)")
    src.add_argument("--synthetic-rate", type=float, metavar="PER_HOUR",
                     help="a synthetic Poisson trace with this spot preemption rate instead")
    src.add_argument("--from-store", metavar="URL",
                     help="the preemptions recorded in this cairn store's outcome records")
    parser.add_argument("--key", action="append", default=None,
                        help="with --from-store: only these keys (repeatable; default all)")
    parser.add_argument("--spot-name", default="a100-spot",
                        help="name of the spot option (the trace's option column)")
    parser.add_argument("--on-demand-name", default="a100-ondemand")
    parser.add_argument("--steps", type=int, default=12, help="number of simulated steps")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--notice-s", type=float, default=15.0,
                        help="preemption notice window in seconds (GKE spot pods: about 15)")
    parser.add_argument("--restart-s", type=float, default=120.0)
    parser.add_argument("--fixed-interval", type=float, default=1800.0,
                        help="seconds between snapshots for the fixed strategy")
    parser.add_argument("--max-preemptions", type=int, default=PolicySettings().max_preemptions,
                        help="K: the policy leaves spot after this many preemptions")
    parser.add_argument("--sweep", choices=("full", "small", "none"), default="full",
                        help="sensitivity sweep size (full: 3x3x3 cells; small: 2x1x2)")
    parser.add_argument("--plot", type=Path, default=Path(".bench/simulate.png"),
                        help="where to write the PNG (default .bench/simulate.png)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.key and not args.from_store:
        parser.error("--key needs --from-store URL")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sim = SimSettings(restart_s=args.restart_s, fixed_interval_s=args.fixed_interval,
                      notice_s=args.notice_s,
                      policy=PolicySettings(max_preemptions=args.max_preemptions))
    try:
        if args.from_store:
            trace = trace_from_store(args.from_store, args.key)
        elif args.synthetic_rate is not None:
            trace = synthetic_trace(rates_per_h={args.spot_name: args.synthetic_rate},
                                    period_h=24 * 30, seed=args.seed,
                                    maintenance_per_h={args.on_demand_name: 1 / 720})
        else:
            trace = read_trace_csv(args.trace)
        options = default_options(spot_name=args.spot_name, on_demand_name=args.on_demand_name,
                                  notice_s=args.notice_s)
        steps = default_steps(args.steps, seed=args.seed)
        results = run(steps, options, trace, sim)
    except ConfigError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    n_events = len(trace.events)
    spot_events = sum(e.option == args.spot_name and e.kind == "preempt" for e in trace.events)
    print(f"SIMULATED, not measured. trace: {trace.source} ({n_events} events, "
          f"{spot_events} spot preemptions in {trace.period_s / 3600:.1f} h); "
          f"{len(steps)} steps, {sum(s.work_h * s.gpus for s in steps):.0f} GPU-h of work; "
          f"notice {args.notice_s:g} s, restart {args.restart_s:g} s, "
          f"prices {', '.join(f'{o.name} ${o.price_per_hour}/h' for o in options)}")
    print(table(results))
    rows: list[dict[str, Any]] = []
    if args.sweep != "none":
        rates, costs, notices = ((0.05, 0.3, 1.0), (10.0, 60.0, 300.0), (15.0, 30.0, 120.0)) \
            if args.sweep == "full" else ((0.3, 1.0), (60.0,), (15.0, 120.0))
        rows = sweep(rates, costs, notices, n_steps=min(args.steps, 8), seed=args.seed, sim=sim,
                     spot_name=args.spot_name, on_demand_name=args.on_demand_name)
        print()
        print(sweep_table(rows))
    if not args.no_plot:
        plot(results, rows, args.plot, trace.source)
        print(f"plot: {args.plot}")
    print(json.dumps({"strategies": {name: t.summary() for name, t in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
