"""Capacity options: the places a try can run, with their price, speed and how to get there.

An option is what a pod can be *told* before it starts: a GKE custom ComputeClass, a Kueue
LocalQueue (whose ClusterQueue's flavors are, say, spot-only), or a plain node selector with
tolerations and a priority class. :meth:`CapacityOption.pod_fields` renders it as plain pod-spec
fields, so the integrations (Airflow's pod operator, KFP's task config) apply it without this
package importing a Kubernetes client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from cairn.exceptions import ConfigError

# GKE labels a node whose maintenance is scheduled with this label (value: the time).
MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"
COMPUTE_CLASS_LABEL = "cloud.google.com/compute-class"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# GKE spot nodes: the label to select them and the taint GKE puts on them.
GKE_SPOT_SELECTOR = MappingProxyType({"cloud.google.com/gke-spot": "true"})
GKE_SPOT_TOLERATION = MappingProxyType({"key": "cloud.google.com/gke-spot", "operator": "Equal",
                                        "value": "true", "effect": "NoSchedule"})


@dataclass(frozen=True)
class CapacityOption:
    """A named place to run a try.

    ``price_per_hour``: what one try pays per hour on it (any currency, the same for all
    options); ``relative_speed``: work per hour relative to a reference (1.0); ``spot``: the
    capacity can be reclaimed at short notice. ``notice_s``: how long a reclaim notice gives
    the pod (GKE spot: about 15 s; 0 when there is none). ``prior_mtbf_h``: the mean time
    between preemptions to assume before the step has history on this option (None: the
    policy's default for spot or on-demand).

    How to place it (any combination): ``compute_class`` (a GKE custom ComputeClass name),
    ``kueue_queue`` (a Kueue LocalQueue name), ``node_selector``, ``tolerations`` (Kubernetes
    toleration objects as dicts), ``priority_class``.
    """

    name: str
    price_per_hour: float
    relative_speed: float = 1.0
    spot: bool = False
    notice_s: float = 0.0
    prior_mtbf_h: float | None = None
    compute_class: str | None = None
    kueue_queue: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    priority_class: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError("a capacity option needs a name, such as 'a100-spot'")
        if not _positive(self.price_per_hour, allow_zero=True):
            raise ConfigError(f"option {self.name!r}: price_per_hour must be a finite number >= 0")
        if not _positive(self.relative_speed):
            raise ConfigError(f"option {self.name!r}: relative_speed must be a finite number > 0 "
                              "(1.0 for the reference machine)")
        if not _positive(self.notice_s, allow_zero=True):
            raise ConfigError(f"option {self.name!r}: notice_s must be a finite number >= 0")
        if self.prior_mtbf_h is not None and not _positive(self.prior_mtbf_h):
            raise ConfigError(f"option {self.name!r}: prior_mtbf_h must be > 0 hours or None")
        if isinstance(self.tolerations, Mapping):
            raise ConfigError(f"option {self.name!r}: tolerations is a list of toleration dicts")
        object.__setattr__(self, "node_selector", MappingProxyType(dict(self.node_selector)))
        object.__setattr__(self, "tolerations",
                           tuple(MappingProxyType(dict(t)) for t in self.tolerations))
        for k, v in self.node_selector.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"option {self.name!r}: node_selector maps label names to "
                                  "string values")

    @classmethod
    def gke_spot(cls, name: str, *, price_per_hour: float, relative_speed: float = 1.0,
                 notice_s: float = 15.0, **kwargs: Any) -> CapacityOption:
        """GKE Spot VMs selected by label, with GKE's spot taint tolerated."""
        selector = {**GKE_SPOT_SELECTOR, **dict(kwargs.pop("node_selector", {}))}
        tolerations = (GKE_SPOT_TOLERATION, *kwargs.pop("tolerations", ()))
        return cls(name, price_per_hour, relative_speed, spot=True, notice_s=notice_s,
                   node_selector=selector, tolerations=tolerations, **kwargs)

    @property
    def price_per_work(self) -> float:
        """Price of one hour of reference work, before any preemption losses."""
        return self.price_per_hour / self.relative_speed

    def pod_fields(self, *, avoid_maintenance: bool = False) -> dict[str, Any]:
        """The pod-spec fields that put a pod on this option, as plain JSON data:
        ``nodeSelector``, ``tolerations``, ``priorityClassName``, ``affinity`` (keys present only
        when set) and ``labels`` (pod metadata labels, for Kueue)."""
        out: dict[str, Any] = {}
        selector = dict(self.node_selector)
        if self.compute_class:
            selector[COMPUTE_CLASS_LABEL] = self.compute_class
        if selector:
            out["nodeSelector"] = selector
        if self.tolerations:
            out["tolerations"] = [dict(t) for t in self.tolerations]
        if self.priority_class:
            out["priorityClassName"] = self.priority_class
        if self.kueue_queue:
            out["labels"] = {KUEUE_QUEUE_LABEL: self.kueue_queue}
        if avoid_maintenance:
            out["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": MAINTENANCE_LABEL, "operator": "DoesNotExist"}]}]}}}
        return out


def _positive(value: object, *, allow_zero: bool = False) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value >= 0 if allow_zero else value > 0


def check_options(options: object) -> tuple[CapacityOption, ...]:
    """The options as a tuple; ConfigError when empty, not options, or names repeat."""
    if isinstance(options, CapacityOption):
        options = (options,)
    try:
        out = tuple(options)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError("options must be a list of CapacityOption") from None
    if not out:
        raise ConfigError("give at least one capacity option (a spot one and an on-demand one, "
                          "typically)")
    names = set()
    for option in out:
        if not isinstance(option, CapacityOption):
            raise ConfigError("options must be CapacityOption objects, got "
                              f"{type(option).__name__}")
        if option.name in names:
            raise ConfigError(f"two capacity options are named {option.name!r}; names must differ")
        names.add(option.name)
    return out
