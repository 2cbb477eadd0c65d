"""CapacityOption: validation that names the fix, and the pod-spec fields it renders."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.policy import CapacityOption


def test_each_way_of_placing_renders_its_pod_fields() -> None:
    spot = CapacityOption.gke_spot("l4-spot", price_per_hour=0.3, relative_speed=0.4,
                                   node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"},
                                   priority_class="batch-low")
    assert spot.spot and spot.notice_s == 15.0
    assert spot.pod_fields() == {
        "nodeSelector": {"cloud.google.com/gke-spot": "true",
                         "cloud.google.com/gke-accelerator": "nvidia-l4"},
        "tolerations": [{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                         "value": "true", "effect": "NoSchedule"}],
        "priorityClassName": "batch-low",
    }
    assert spot.price_per_work == pytest.approx(0.75)
    klass = CapacityOption("cc", 2.0, compute_class="gpu-spot-first")
    assert klass.pod_fields() == {"nodeSelector": {"cloud.google.com/compute-class":
                                                   "gpu-spot-first"}}
    queue = CapacityOption("kq", 2.0, kueue_queue="team-a-ondemand")
    assert queue.pod_fields() == {"labels": {"kueue.x-k8s.io/queue-name": "team-a-ondemand"}}


def test_options_are_immutable_and_equal_by_value() -> None:
    a = CapacityOption("x", 1.0, node_selector={"k": "v"})
    with pytest.raises(TypeError):
        a.node_selector["k"] = "w"  # type: ignore[index]
    assert a == CapacityOption("x", 1.0, node_selector={"k": "v"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(name=""), "needs a name"),
    (dict(price_per_hour=-1.0), "price_per_hour"),
    (dict(price_per_hour=float("inf")), "price_per_hour"),
    (dict(relative_speed=0.0), "relative_speed"),
    (dict(notice_s=-5.0), "notice_s"),
    (dict(prior_mtbf_h=0.0), "prior_mtbf_h"),
    (dict(tolerations={"key": "a"}), "list of toleration dicts"),
    (dict(node_selector={"k": 1}), "string values"),
])
def test_bad_options_name_the_fix(kwargs: dict, match: str) -> None:
    fields = dict(name="x", price_per_hour=1.0) | kwargs
    with pytest.raises(ConfigError, match=match):
        CapacityOption(**fields)
