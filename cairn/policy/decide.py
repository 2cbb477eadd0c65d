"""Where the next try runs and how often it snapshots: :func:`decide`.

The model, per capacity option, from the step's own history (:class:`History`) and priors:

* **Interruption rate** λ: ``(n + 1) / (h + prior MTBF)`` — the n preemptions and evictions the
  step saw in h hours on that option, after one assumed interruption per prior MTBF (a Gamma
  prior): with no history it is the prior, and it follows the evidence as hours pile up. Only
  the capacity's doing counts (the outcome records that say so), over hours worked on that
  option, since it compares options; it is not ``Checkpointer.mtbf_s``, the wall time between
  any two starts of the key's tries, whatever ended them and whether or not that was recorded.
* **Snapshot interval** τ: Young–Daly ``sqrt(2 · C · MTBF)`` from the median measured snapshot
  cost C (a prior when nothing was measured) and MTBF = 1/λ, clamped to ``[min, max]``.
* **Loss per interruption** L: restore cost R + restart delay d + the work since the last
  snapshot, τ/2 on average (τ at worst) — or only the final snapshot's cost C when the option's
  notice window fits C.
* **Expected wall time** for W hours of reference work at speed s:
  ``T = (W/s) · (1 + C/τ) / (1 − λ·L)`` (snapshot overhead, then each hour loses λ·L hours);
  infinite when λ·L ≥ 1 (the step cannot get ahead of its losses there).
* **Cost per unit of work**: ``price / s · T / (W/s)``: the price inflated by the losses.
* **Time needed at risk**: ``(W/s) · (1 + C/τ) + n_q · L_worst``, where n_q is the number of
  interruptions not exceeded with probability ``risk_quantile`` (Poisson with mean λ·T).

Rules, in order: after ``max_preemptions`` spot preemptions only non-spot options are kept;
with a deadline, only options whose time needed at risk fits the slack are kept (none fits: the
one needing least time is taken); among those left the cheapest per unit of work wins (spot
first on ties). Every :class:`Placement` carries a one-line ``reason``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from cairn.exceptions import ConfigError
from cairn.policy.history import History
from cairn.policy.options import CapacityOption, check_options
from cairn.runtime import env
from cairn.runtime.interval import young_daly_interval

log = logging.getLogger(__name__)


_FIT_TOLERANCE_H = 1e-3 / 3600.0


@dataclass(frozen=True)
class PolicySettings:
    """Knobs of :func:`decide`; the defaults suit GPU training steps of hours.

    ``max_preemptions`` (K): spot preemptions of the step after which it leaves spot.
    ``min_interval_s``/``max_interval_s``: bounds of the snapshot interval.
    ``prior_snapshot_cost_s``/``prior_restore_cost_s``: assumed until measured (restore
    defaults to the snapshot cost). ``spot_prior_mtbf_h``/``on_demand_prior_mtbf_h``: assumed
    mean time between interruptions when an option gives none. ``restart_s``: time from an
    interruption until the next try works (rescheduling, node start, image pull).
    ``risk_quantile``: how sure the deadline check wants to be. ``avoid_maintenance``: keep
    new pods off nodes with scheduled maintenance.
    """

    max_preemptions: int = 3
    min_interval_s: float = 60.0
    max_interval_s: float = 3600.0
    prior_snapshot_cost_s: float = 30.0
    prior_restore_cost_s: float | None = None
    spot_prior_mtbf_h: float = 6.0
    on_demand_prior_mtbf_h: float = 720.0
    restart_s: float = 120.0
    risk_quantile: float = 0.9
    avoid_maintenance: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_preemptions, int) or self.max_preemptions < 1:
            raise ConfigError("max_preemptions must be an integer >= 1")
        if not 0 < self.min_interval_s <= self.max_interval_s:
            raise ConfigError("need 0 < min_interval_s <= max_interval_s")
        for name in ("prior_snapshot_cost_s", "restart_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0 seconds")
        if self.prior_restore_cost_s is not None and not self.prior_restore_cost_s >= 0:
            raise ConfigError("prior_restore_cost_s must be >= 0 seconds or None")
        if not (self.spot_prior_mtbf_h > 0 and self.on_demand_prior_mtbf_h > 0):
            raise ConfigError("prior MTBFs must be > 0 hours")
        if not 0 < self.risk_quantile < 1:
            raise ConfigError("risk_quantile must be between 0 and 1, such as 0.9")


@dataclass(frozen=True)
class OptionEstimate:
    """What the model expects of one option for this step (see the module docstring)."""

    option: CapacityOption
    interruptions: int
    mtbf_h: float
    snapshot_cost_s: float
    interval_s: float
    notice_fits: bool
    loss_h: float
    cost_per_work: float
    expected_h: float | None
    needed_h: float | None


@dataclass(frozen=True)
class Placement:
    """The decision for the next try. ``reason`` is one line, for logs and outcome records."""

    option: CapacityOption
    snapshot_interval_s: float
    avoid_maintenance: bool
    snapshot_on_notice: bool
    reason: str
    estimates: tuple[OptionEstimate, ...] = ()

    def pod_fields(self) -> dict[str, object]:
        """Pod-spec fields placing the try (see :meth:`CapacityOption.pod_fields`). A pod that
        also goes through ``cairn.k8s.with_snapshot_sidecar`` should take
        ``option.pod_fields()`` and pass ``avoid_maintenance`` to the transform, which ANDs the
        expression into the pod's existing node-affinity terms instead of replacing them."""
        return self.option.pod_fields(avoid_maintenance=self.avoid_maintenance)

    @property
    def every(self) -> str:
        """The interval as ``cairn run --every`` and ``with_snapshot_sidecar(every=)`` take it."""
        return f"{max(1, round(self.snapshot_interval_s))}s"

    @property
    def options(self) -> tuple[str, ...]:
        """The names of every option it was chosen from (what a resume may move the step to)."""
        return tuple(e.option.name for e in self.estimates) or (self.option.name,)

    def env(self) -> dict[str, str]:
        """Environment for the try: its snapshot interval (the Checkpointer's
        ``CAIRN_EVERY_SECONDS``) and the option, reason and option names to copy into its
        outcome record."""
        return {env.EVERY_SECONDS.name: str(max(1, round(self.snapshot_interval_s))),
                env.PLACEMENT_OPTION.name: self.option.name,
                env.PLACEMENT_REASON.name: self.reason,
                env.PLACEMENT_OPTIONS.name: json.dumps(list(self.options))}


def _seconds(value: float | datetime | None, *, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ConfigError(f"{what} must be timezone-aware (e.g. datetime.now(timezone.utc))")
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ConfigError(f"{what} must be seconds since the epoch or an aware datetime")


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest n with P(N <= n) >= q for N ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    if mean > 500:  # normal approximation; the pmf loop would underflow
        return max(0, math.ceil(mean + 1.2816 * math.sqrt(mean) * (q / 0.9)))
    n, pmf = 0, math.exp(-mean)
    total = pmf
    while total < q:
        n += 1
        pmf *= mean / n
        total += pmf
    return n


def estimate_option(option: CapacityOption, history: History, *,
                    remaining_work_h: float | None,
                    settings: PolicySettings = PolicySettings()) -> OptionEstimate:
    """The model's figures for ``option`` (see the module docstring)."""
    prior = option.prior_mtbf_h or (settings.spot_prior_mtbf_h if option.spot
                                    else settings.on_demand_prior_mtbf_h)
    n = history.interruptions_on(option.name)
    rate = (n + 1) / (history.hours_on(option.name) + prior)
    mtbf_h = 1.0 / rate
    cost_s = history.snapshot_cost_s()
    cost_s = settings.prior_snapshot_cost_s if cost_s is None else cost_s
    restore_s = history.restore_cost_s()
    if restore_s is None:
        restore_s = settings.prior_restore_cost_s
        restore_s = cost_s if restore_s is None else restore_s
    interval_s = young_daly_interval(snapshot_cost_s=cost_s, mtbf_s=mtbf_h * 3600.0,
                                     lower_s=settings.min_interval_s,
                                     upper_s=settings.max_interval_s)
    notice_fits = option.notice_s > 0 and cost_s <= option.notice_s
    lost_s, worst_s = (cost_s, cost_s) if notice_fits else (interval_s / 2, interval_s)
    loss_h = (restore_s + settings.restart_s + lost_s) / 3600.0
    worst_h = (restore_s + settings.restart_s + worst_s) / 3600.0
    slowdown = 1.0 + cost_s / interval_s
    keep = 1.0 - rate * loss_h
    inflation = slowdown / keep if keep > 0 else math.inf
    expected_h = needed_h = None
    if remaining_work_h is not None:
        compute_h = remaining_work_h / option.relative_speed
        expected_h = compute_h * inflation
        n_q = poisson_quantile(rate * expected_h, settings.risk_quantile) \
            if math.isfinite(expected_h) else math.inf
        needed_h = compute_h * slowdown + n_q * worst_h if remaining_work_h > 0 else 0.0
    return OptionEstimate(option, n, mtbf_h, cost_s, interval_s, notice_fits, loss_h,
                          option.price_per_work * inflation, expected_h, needed_h)


def decide(options: Iterable[CapacityOption], history: History | None = None, *,
           deadline: float | datetime | None = None, now: float | datetime | None = None,
           remaining_work_h: float | None = None,
           settings: PolicySettings = PolicySettings()) -> Placement:
    """Choose the option, snapshot interval and maintenance avoidance for the next try.

    ``deadline``/``now``: seconds since the epoch or aware datetimes (``now`` defaults to the
    clock). ``remaining_work_h``: hours of reference-machine work left; default: estimated from
    the history (needs ``total_steps`` and measured pace), and without it the deadline cannot
    be checked (the reason says so). Deterministic for given inputs; never returns an option
    not in ``options``.
    """
    opts = check_options(options)
    history = history or History()
    now_s = _seconds(now, what="now")
    now_s = time.time() if now_s is None else now_s
    deadline_s = _seconds(deadline, what="deadline")
    if remaining_work_h is None:
        remaining_work_h = history.remaining_work_h({o.name: o.relative_speed for o in opts})
    elif not (isinstance(remaining_work_h, (int, float)) and remaining_work_h >= 0):
        raise ConfigError("remaining_work_h must be a number of hours >= 0")
    estimates = tuple(estimate_option(o, history, remaining_work_h=remaining_work_h,
                                      settings=settings) for o in opts)

    def cheapest(pool: Iterable[OptionEstimate]) -> OptionEstimate:
        return min(pool, key=lambda e: (e.cost_per_work, not e.option.spot, e.option.name))

    pool = list(estimates)
    why: list[str] = []
    preempted = history.preemptions()
    steady = [e for e in pool if not e.option.spot]
    if preempted >= settings.max_preemptions and steady and len(steady) < len(pool):
        pool = steady
        why.append(f"{preempted} preemptions >= K={settings.max_preemptions}: off spot")
    if deadline_s is not None:
        slack_h = (deadline_s - now_s) / 3600.0
        if remaining_work_h is None:
            why.append("deadline not checked: remaining work unknown (record total_steps)")
        else:
            # A deadline handed over as a timestamp loses a few ulps; a millisecond of
            # tolerance keeps "needs exactly the slack" on the side of fitting.
            fits = [e for e in pool
                    if e.needed_h is not None and e.needed_h <= slack_h + _FIT_TOLERANCE_H]
            best = cheapest(pool)
            if fits:
                choice = cheapest(fits)
                if choice is not best:
                    why.append(f"slack {slack_h:.2f} h < {_h(best.needed_h)} needed on "
                               f"{best.option.name} (p{settings.risk_quantile * 100:.0f}, "
                               f"MTBF {best.mtbf_h:.1f} h)")
                else:
                    why.append(f"slack {slack_h:.2f} h >= {_h(choice.needed_h)} needed "
                               f"(p{settings.risk_quantile * 100:.0f})")
                pool = fits
            else:
                fastest = min(pool, key=lambda e: (e.needed_h, e.option.name))
                why.append(f"deadline at risk: slack {slack_h:.2f} h < {_h(fastest.needed_h)} "
                           "needed even on the fastest option")
                pool = [fastest]
    unrecorded = history.unrecorded_tries()
    if unrecorded:
        why.append(f"{len(unrecorded)} earlier tries have no outcome record (not counted)")
    choice = cheapest(pool)
    head = (f"{choice.option.name}: {'spot' if choice.option.spot else 'on-demand'}, "
            f"{choice.cost_per_work:.2f}/work-h incl. losses (MTBF {choice.mtbf_h:.1f} h, "
            f"{choice.interruptions} interruptions on it)")
    notice = "; final snapshot fits notice" if choice.notice_fits else ""
    tail = (f"snapshot every {choice.interval_s:.0f} s (Young-Daly, cost "
            f"{choice.snapshot_cost_s:.0f} s){notice}")
    reason = "; ".join([head, *why, tail])
    log.info("placement: %s", reason)
    return Placement(option=choice.option, snapshot_interval_s=choice.interval_s,
                     avoid_maintenance=settings.avoid_maintenance,
                     snapshot_on_notice=choice.notice_fits, reason=reason, estimates=estimates)


def place_as_asked(options: Iterable[CapacityOption], name: str, *, by: str,
                   history: History | None = None, deadline: float | datetime | None = None,
                   now: float | datetime | None = None,
                   settings: PolicySettings = PolicySettings()) -> Placement:
    """The next try on option ``name``, as a resume request from ``by`` asked (``cairn resume
    --placement``): the option is the operator's choice, the snapshot interval still the
    policy's for that option. Raises ConfigError naming the options when ``name`` is none of
    them."""
    opts = check_options(options)
    chosen = next((o for o in opts if o.name == name), None)
    if chosen is None:
        raise ConfigError(f"no capacity option is named {name!r}; this step's options are "
                          f"{', '.join(o.name for o in opts)}")
    policy = decide(opts, history, deadline=deadline, now=now, settings=settings)
    estimate = next(e for e in policy.estimates if e.option.name == name)
    notice = "; final snapshot fits notice" if estimate.notice_fits else ""
    reason = (f"moved by resume request from {by}: {name} "
              f"({'spot' if chosen.spot else 'on-demand'}; the policy would choose "
              f"{policy.option.name}); snapshot every {estimate.interval_s:.0f} s{notice}")
    reason = " ".join(reason.split())  # one line, whatever ``by`` holds
    log.info("placement: %s", reason)
    return dataclasses.replace(policy, option=chosen, snapshot_interval_s=estimate.interval_s,
                               snapshot_on_notice=estimate.notice_fits, reason=reason)


def _h(hours: float | None) -> str:
    return "inf h" if hours is None or not math.isfinite(hours) else f"{hours:.2f} h"


def summarize(estimates: Iterable[OptionEstimate]) -> Mapping[str, dict[str, float | None]]:
    """The estimates as plain data (for logs, the outcome record's ``detail``, a UI)."""
    def finite(x: float | None) -> float | None:
        return x if x is not None and math.isfinite(x) else None

    return {e.option.name: {"mtbf_h": finite(e.mtbf_h), "interval_s": finite(e.interval_s),
                            "cost_per_work": finite(e.cost_per_work),
                            "expected_h": finite(e.expected_h), "needed_h": finite(e.needed_h)}
            for e in estimates}
