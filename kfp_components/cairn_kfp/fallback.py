"""Spot first, then on demand: one step as two KFP tasks that share one cairn key.

KFP cannot move a running task, nor change a retry's node: a task's placement is fixed when the
pipeline is compiled. So the per-try choice "spot while it works, on-demand when spot keeps
failing" becomes two tasks::

    @dsl.pipeline
    def pipeline():
        spot, fallback = cairn_kfp.with_fallback(
            train, spot_retries=3, backoff="60s",
            on_demand=CapacityOption("a100", price_per_hour=3.7, compute_class="a100-on-demand"),
            epochs=3)
        for task in (spot, fallback):
            use_gcs_store(task, "gs://my-bucket/cairn")
        evaluate(model=fallback.output)      # always the step's result

- the **spot task**: on spot capacity, retried ``spot_retries`` times (each retry resumes);
- the **fallback task**: ``.after(spot)`` with ``ignore_upstream_failure()``, so it runs once
  the spot task ended either way; on on-demand capacity; same key, so it resumes from the
  spot task's last snapshot. When the spot task finished the work, the fallback finds that run's
  stored result and returns it without calling the function (a done key would otherwise start
  over). Downstream tasks read the fallback's outputs: they are the step's result either way.

Every try files its outcome record in the store (``cairn.store.outcomes``); the pattern sets
``CAIRN_PLACEMENT_OPTION``/``CAIRN_PLACEMENT_REASON`` on both tasks, so the records name the
capacity option and the pattern's one-line reason, which ``cairn.policy.History`` reads. A try
killed from outside (a spot reclaim whose SIGTERM ends the process, a node loss) leaves none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kfp import kubernetes
from kfp.dsl import PipelineTask
from kfp.dsl.pipeline_channel import PipelineChannel
from kfp.dsl.types import type_utils

from cairn.exceptions import ConfigError
from cairn.policy import MAINTENANCE_LABEL, CapacityOption
from cairn.runtime import env as contract
from cairn_kfp.component import CairnComponent
from cairn_kfp.kubernetes import set_retries, use_spot_nodes

#: The option names recorded when ``spot=`` / ``on_demand=`` are left out.
DEFAULT_SPOT_NAME = "gke-spot"
DEFAULT_ON_DEMAND_NAME = "on-demand"


class FallbackTasks(NamedTuple):
    """The two tasks of :func:`with_fallback`; read the step's outputs from ``fallback``."""

    spot: PipelineTask
    fallback: PipelineTask


def apply_option(task: PipelineTask, option: CapacityOption, *,
                 avoid_maintenance: bool = False) -> PipelineTask:
    """Place ``task`` on ``option``: its node selector (incl. a GKE ComputeClass), tolerations,
    Kueue queue label and, with ``avoid_maintenance``, a required node affinity away from nodes
    with scheduled maintenance (:meth:`CapacityOption.pod_fields`). ConfigError for a priority
    class, which kfp-kubernetes cannot set."""
    fields = option.pod_fields(avoid_maintenance=avoid_maintenance)
    if "priorityClassName" in fields:
        raise ConfigError(f"option {option.name!r}: kfp-kubernetes cannot set a pod's priority "
                          "class; use a GKE ComputeClass (compute_class=), a Kueue queue "
                          "(kueue_queue=) or a node selector for KFP tasks")
    for label, value in fields.get("nodeSelector", {}).items():
        kubernetes.add_node_selector(task, label_key=label, label_value=value)
    for toleration in fields.get("tolerations", []):
        seconds = toleration.get("tolerationSeconds")
        kubernetes.add_toleration(task, key=toleration.get("key"),
                                  operator=toleration.get("operator"),
                                  value=toleration.get("value"),
                                  effect=toleration.get("effect"),
                                  toleration_seconds=int(seconds) if seconds is not None else None)
    for label, value in fields.get("labels", {}).items():
        kubernetes.add_pod_label(task, label_key=label, label_value=value)
    if "affinity" in fields:
        avoid_maintenance_nodes(task)
    return task


def avoid_maintenance_nodes(task: PipelineTask) -> PipelineTask:
    """Keep ``task`` off nodes that GKE labels with scheduled maintenance (a required node
    affinity: the label does not exist)."""
    kubernetes.add_node_affinity(task, match_expressions=[
        {"key": MAINTENANCE_LABEL, "operator": "DoesNotExist"}])
    return task


def _ignore_upstream_failure(task: PipelineTask) -> None:
    """``task.ignore_upstream_failure()``, which in kfp 2.17 looks up every input of the
    component, also the defaulted ones not passed (``KeyError``). Its rule is kept: an input fed
    by another task's output needs a default, as a failed task leaves no output."""
    specs = task.component_spec.inputs or {}
    for name, value in task.inputs.items():
        if isinstance(value, PipelineChannel) and value.task_name is not None and \
                name in specs and not specs[name].optional:
            raise ConfigError(
                f"with_fallback: input {name!r} comes from task {value.task_name!r} and has no "
                "default; the fallback runs even when upstream tasks failed, so give the "
                "parameter a default")
    try:
        task.ignore_upstream_failure()
    except KeyError:
        task._ignore_upstream_failure_tag = True  # what the method sets once its check passes


def _check_component(component: Any) -> CairnComponent:
    if not isinstance(component, CairnComponent):
        raise ConfigError("with_fallback takes a component made by @cairn_kfp.component (or "
                          "cairn_kfp.train); a plain or loaded component has no cairn key to "
                          "share between the two tasks")
    outputs = component.component.component_spec.outputs or {}
    artifacts = sorted(name for name, spec in outputs.items()
                       if not type_utils.is_parameter_type(spec.type))
    if artifacts:
        raise ConfigError(
            f"{component.name}: with_fallback needs a component whose outputs are parameters; "
            f"{artifacts} are artifacts, which the fallback could not hand on when the spot "
            "task already finished the work. Return parameters (e.g. the store key or a URI) "
            "instead")
    return component


def _options(component: CairnComponent, given: Any) -> dict[str, Any]:
    if given is not None and not isinstance(given, Mapping):
        raise ConfigError("with_fallback: cairn_options must be a literal dict (a pipeline "
                          "parameter cannot be merged with the pattern's options)")
    return {**dict(component.settings.options), **dict(given or {}), "share_result": True}


def set_placement_env(task: PipelineTask, option: str, reason: str) -> PipelineTask:
    """``CAIRN_PLACEMENT_OPTION``/``CAIRN_PLACEMENT_REASON`` (the names of
    ``cairn.policy.Placement.env()``): each try's outcome record names the option it ran on
    and why it was put there."""
    task.set_env_variable(contract.PLACEMENT_OPTION.name, option)
    task.set_env_variable(contract.PLACEMENT_REASON.name, reason)
    return task


def with_fallback(component: Any, *, name: str | None = None,
                  spot: CapacityOption | None = None, on_demand: CapacityOption | None = None,
                  spot_retries: int = 3, backoff: str = "60s", fallback_retries: int = 0,
                  avoid_maintenance: bool = False, **arguments: Any) -> FallbackTasks:
    """Call ``component`` twice inside a ``@dsl.pipeline``: a spot task, then an on-demand
    fallback that resumes its work (see the module docstring). Returns ``(spot, fallback)``.

    ``arguments`` are the component's own (and cairn's: ``cairn_store``, ``cairn_key``,
    ``cairn_checkpoint_prefix``, a literal ``cairn_options`` dict), passed to both tasks. The
    shared key is ``cairn_key`` when given, else ``(checkpoint prefix or job id, name[, loop
    item])`` with ``name`` defaulting to the component's name: both tasks pass it as
    ``cairn_task_name`` (KFP names the two tasks apart). The result handed from the spot task
    to the fallback is kept per pipeline run, so a key reused across runs never returns an older
    run's result.

    ``spot``: where the spot task runs (``spot=True`` option; default: GKE Spot VMs by label
    and toleration). ``on_demand``: where the fallback runs (a non-spot option; default: no
    placement, i.e. the cluster's default nodes — GKE's spot taint keeps it off spot nodes).
    The spot task is retried ``spot_retries`` times with ``backoff`` (doubling); the fallback
    ``fallback_retries`` times (0: none). ``avoid_maintenance`` keeps both off nodes with
    scheduled maintenance. ConfigError for a component whose outputs include artifacts.
    """
    component = _check_component(component)
    if spot is not None and (not isinstance(spot, CapacityOption) or not spot.spot):
        raise ConfigError("spot= must be a CapacityOption with spot=True (e.g. "
                          "CapacityOption.gke_spot(...)); for two on-demand tries use "
                          "set_retries on one task")
    if on_demand is not None and (not isinstance(on_demand, CapacityOption) or on_demand.spot):
        raise ConfigError("on_demand= must be a CapacityOption with spot=False: the fallback "
                          "exists to leave spot capacity")
    if not isinstance(fallback_retries, int) or fallback_retries < 0:
        raise ConfigError("fallback_retries must be an integer >= 0")
    step = name or component.name
    if not isinstance(step, str) or not step or "{{$." in step:
        raise ConfigError("name= must be plain text: the second key component of both tasks")
    spot_name = spot.name if spot is not None else DEFAULT_SPOT_NAME
    demand_name = on_demand.name if on_demand is not None else DEFAULT_ON_DEMAND_NAME
    given = arguments.pop("cairn_options", None)
    shared = dict(arguments)
    if not shared.get("cairn_key"):
        shared.setdefault("cairn_task_name", step)

    spot_task = component(**shared, cairn_options=_options(component, given))
    set_placement_env(spot_task, spot_name,
                      f"{spot_name}: spot first, {spot_retries} retries resuming from the last "
                      f"snapshot, then {demand_name} (cairn_kfp.with_fallback)")
    if spot is None:
        use_spot_nodes(spot_task)
        if avoid_maintenance:
            avoid_maintenance_nodes(spot_task)
    else:
        apply_option(spot_task, spot, avoid_maintenance=avoid_maintenance)
    set_retries(spot_task, spot_retries, backoff=backoff)
    spot_task.set_display_name(f"{step} (spot)")

    fallback_task = component(**shared, cairn_options=_options(component, given))
    set_placement_env(fallback_task, demand_name,
                      f"{demand_name}: on-demand fallback after the spot task ended without "
                      "the result; resumes from its last snapshot (cairn_kfp.with_fallback)")
    fallback_task.after(spot_task)
    _ignore_upstream_failure(fallback_task)
    if on_demand is not None:
        apply_option(fallback_task, on_demand, avoid_maintenance=avoid_maintenance)
    elif avoid_maintenance:
        avoid_maintenance_nodes(fallback_task)
    if fallback_retries:
        set_retries(fallback_task, fallback_retries, backoff=backoff)
    fallback_task.set_display_name(f"{step} (on-demand fallback)")
    return FallbackTasks(spot_task, fallback_task)
