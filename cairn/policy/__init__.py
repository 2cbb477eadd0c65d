"""Placement and snapshot interval for the next try of a resumable step.

``decide(options, History.from_store(store, key), deadline=...)`` returns a :class:`Placement`:
the capacity option (spot first, cheapest per unit of work; on-demand after K preemptions or when
the deadline is at risk), the snapshot interval (Young–Daly), whether to avoid nodes with
scheduled maintenance, and a one-line reason. Pure and deterministic: no clock unless ``now`` is
left out, no I/O except :meth:`History.from_store`. Imports neither Kubernetes nor torch.

``place_as_asked(options, name, by=...)`` places the try a resume request moved to option
``name`` (``cairn resume --placement``), with the policy's interval for it.

``plan_resume(History.from_store(store, key), ResumePolicy(...))`` says which snapshots the
next try may restore and whether it should run at all (errors versus preemptions, a crash
loop's guard); :func:`after_try` whether an ended try retries, stops or is rescheduled.

This package's names (``__all__``) are public API, for the integrations too; its modules are
not.
"""

from __future__ import annotations

from cairn.policy.decide import (
    OptionEstimate,
    Placement,
    PolicySettings,
    decide,
    estimate_option,
    place_as_asked,
    poisson_quantile,
    summarize,
)
from cairn.policy.history import History
from cairn.policy.options import MAINTENANCE_LABEL, CapacityOption, check_options
from cairn.policy.resume import AfterTry, ResumeOn, ResumePlan, ResumePolicy, after_try, plan_resume

__all__ = [
    "MAINTENANCE_LABEL",
    "AfterTry",
    "CapacityOption",
    "History",
    "OptionEstimate",
    "Placement",
    "PolicySettings",
    "ResumeOn",
    "ResumePlan",
    "ResumePolicy",
    "after_try",
    "check_options",
    "decide",
    "estimate_option",
    "place_as_asked",
    "plan_resume",
    "poisson_quantile",
    "summarize",
]
