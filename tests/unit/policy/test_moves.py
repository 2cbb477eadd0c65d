"""``place_as_asked``: a resume request moves the next try to the option it names, with the
policy's snapshot interval for that option and a reason that says who moved it."""

from __future__ import annotations

import json

import pytest

from cairn.exceptions import ConfigError
from cairn.policy import CapacityOption, History, decide, place_as_asked
from cairn.runtime import env
from cairn.store.outcomes import Outcome, OutcomeKind

SPOT = CapacityOption.gke_spot("a100-spot", price_per_hour=1.15)
ON_DEMAND = CapacityOption("a100-ondemand", 3.67, compute_class="a100-ondemand")
T = 1_800_000_000.0


def test_the_named_option_wins_over_the_policy_and_the_reason_says_who_moved_it() -> None:
    history = History(outcomes=(Outcome(epoch=1, outcome=OutcomeKind.SUSPENDED, started_at=T,
                                        ended_at=T + 3600, option=SPOT.name,
                                        snapshot_cost_s=30.0),))
    assert decide([SPOT, ON_DEMAND], history, now=T).option is SPOT
    moved = place_as_asked([SPOT, ON_DEMAND], "a100-ondemand", by="ops@host (Airflow)",
                           history=history, now=T)
    assert moved.option is ON_DEMAND
    assert moved.reason.startswith("moved by resume request from ops@host (Airflow): "
                                   "a100-ondemand (on-demand; the policy would choose a100-spot)")
    [estimate] = [e for e in moved.estimates if e.option is ON_DEMAND]
    assert moved.snapshot_interval_s == estimate.interval_s
    assert moved.pod_fields()["nodeSelector"] == {"cloud.google.com/compute-class":
                                                  "a100-ondemand"}
    values = moved.env()
    assert values[env.PLACEMENT_OPTION.name] == "a100-ondemand"
    assert values[env.PLACEMENT_REASON.name] == moved.reason
    assert json.loads(values[env.PLACEMENT_OPTIONS.name]) == ["a100-spot", "a100-ondemand"]


def test_a_name_that_is_not_an_option_is_refused_with_the_names() -> None:
    with pytest.raises(ConfigError, match="no capacity option is named 'h100'; this step's "
                                          "options are a100-spot, a100-ondemand"):
        place_as_asked([SPOT, ON_DEMAND], "h100", by="ops")


def test_the_reason_stays_one_line() -> None:
    moved = place_as_asked([SPOT, ON_DEMAND], "a100-spot", by="ops\nsomeone", now=T)
    assert "\n" not in moved.reason and "ops someone" in moved.reason
