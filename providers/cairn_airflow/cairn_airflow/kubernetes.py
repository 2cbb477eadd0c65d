"""``CairnKubernetesPodOperator``: a KubernetesPodOperator whose pod runs under cairn.

Contract of one try (the pod-building path, ``build_pod_request_obj``):

- the key is ``(dag_id, task_id, run_id, map_index)`` of the task instance (never the try
  number); the store comes from ``store_url=`` or the ``cairn`` connection, and must be reachable
  from the pod (``gs://`` with Workload Identity, or a path on a mounted volume) as well as from
  the worker when ``placement=`` reads the step's history;
- with ``placement=`` (capacity options), :func:`cairn.policy.decide` chooses the option from
  the step's outcome records in the store; the pod gets that option's node selector
  (ComputeClass), tolerations, priority class and Kueue label, the decision's snapshot interval,
  the maintenance-avoiding affinity, and ``CAIRN_PLACEMENT_OPTION``/``_REASON``/``_OPTIONS``
  so the try's outcome record says where it ran, why, and where it could have run; the one-line
  reason is logged. Airflow cannot move a running task: the choice applies to each *new* pod,
  which is the only per-try choice there is;
- a suspended step resumed with ``cairn resume --placement NAME`` (or the page's placement
  choice) gets its next pod on option ``NAME`` (:func:`cairn.policy.place_as_asked`: the
  policy's interval for it, the reason "moved by resume request from WHO"); later tries are
  placed by the policy again (docs/adr/0031);
- the main container (``base``) gets cairn's transform (:func:`cairn.k8s.with_snapshot_sidecar`):
  in process mode its command becomes ``cairn run ... -- CMD``; it gets the cairn sidecar, the
  shared volume, env and security settings. The attempt's epoch is opened by ``cairn run`` (or
  the Checkpointer) inside the pod, never by the Airflow try, so a retry that reattaches to a
  live pod (``reattach_on_restart``/``durable``, always on here) does not fence it;
- the transform runs inside Airflow's ``pod_mutation_hook`` chain as its first implementation
  (a ``tryfirst`` policy plugin, active only while this operator builds its pod): after
  everything the KubernetesPodOperator adds (secrets, the XCom sidecar, labels) and before the
  administrator's own ``pod_mutation_hook``, which therefore sees, and may adjust, the final
  cairn pod;
- the final pod (after the administrator's hook) is validated strict against Kubernetes
  ``kubernetes_version`` (1.29 or later: native sidecars) with ``kubernetes-validate``; a pod the
  API server would reject fails the try before it is submitted, with a :class:`ConfigError`;
- retries run the image of the first pod: once the first pod has started, its ``imageID`` (a
  repository digest) is kept in Airflow's task state store (3.3+; recorded on the synchronous
  path, not by the deferrable trigger), and later tries replace ``image`` by
  ``repository@sha256:...`` unless the DAG's ``image`` changed meanwhile;
- when the node or the kernel ended the pod before ``cairn run`` could record the try's outcome
  (node shutdown, disruption, eviction, OOMKilled), the operator records it from the pod status,
  so the next placement counts it;
- the base container's exit code stands for the error :func:`cairn.runtime.exits.error_for_exit`
  gives (the codes: :mod:`cairn.runtime.exits`): a preemption raises
  :class:`cairn.exceptions.Preempted`, a fence :class:`cairn.exceptions.Fenced`, a restore that
  failed on the pod's side (exit 8) or a rollback refused there (exit 9)
  ``AirflowFailException``, which spends no retry; a pod ended by the
  node (shutdown, eviction, a ``DisruptionTarget`` condition) is a preemption too, while
  ``OOMKilled`` stays an error;
- a suspension of the main container (on request, or the key was held suspended when the try
  started) defers the task with a resume trigger once the pod is cleaned up, instead
  of failing (no retry used; see :mod:`cairn_airflow.suspend`, ``resume_after`` and
  ``resume_poll``): no pod exists while it waits; once resumed, a new pod is built on a
  worker and resumes from the suspend snapshot;
- rollback refused across pods (ADR 0049): the committed seq the task state store keeps is the
  new pod's annotation ``cairn.dev/committed-seqs``, which its sidecar seeds the pod's files
  from and keeps up (``committed_in_pod=True``: the pods' service account needs
  :func:`cairn.k8s.pod_annotator_rbac`); the worker reads it back while the pod runs and
  after it ended, and keeps the newest in the task state store;
- the resume policy (``resume_on``, ``max_error_retries``, ``loop_guard``,
  ``max_preemptions``; see :mod:`cairn_airflow.resume`) reads the step's history on the
  worker before the pod is built: the snapshots it rules out reach the pod as
  ``CAIRN_EXCLUDE_SEQS`` (read by ``cairn run`` and ``Checkpointer.from_env()``), a step that
  failed too often gets no pod; once the pod has failed it may stop the retries or
  reschedule a preemption.

Importing this module imports the cncf provider but neither torch nor CRIU.
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow.policies import hookimpl
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

from cairn.exceptions import ConfigError
from cairn_airflow import committed
from cairn_airflow.hooks import (
    DEFAULT_CONN_ID,
    SerializesCairnConnection,
    StoreConfig,
    operator_store_config,
    scoped_environ,
)
from cairn_airflow.pod_status import (
    image_digest_from_pod,
    pin_image,
    pod_end_error,
    record_pod_outcome,
)
from cairn_airflow.task_keys import task_key
from cairn_airflow.resume import (
    begin_try,
    raise_verdict,
    refuse_if_given_up,
    resume_policy,
    with_resume_params,
)
from cairn_airflow.suspend import SuspendDeferral, optional_seconds

log = logging.getLogger(__name__)

MIN_KUBERNETES = (1, 29)  # native sidecars (initContainers with restartPolicy: Always)
IMAGE_STATE_KEY = "cairn_image_digest"
POLICY_PLUGIN_NAME = "cairn-airflow-pod-transform"


def parse_kubernetes_version(version: str) -> tuple[int, int]:
    """``"1.29"`` (or ``"v1.30.2"``) as ``(1, 29)``; raises ConfigError below 1.29."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?", str(version).strip())
    if not m:
        raise ConfigError(f"kubernetes_version={version!r}: give MAJOR.MINOR, such as '1.29'")
    parsed = (int(m.group(1)), int(m.group(2)))
    if parsed < MIN_KUBERNETES:
        raise ConfigError(f"kubernetes_version={version!r}: the cairn sidecar is a native sidecar, "
                          "which needs Kubernetes 1.29 or later; upgrade the cluster")
    return parsed


def validate_pod(pod: Any, *, kubernetes_version: str = "1.29", what: str = "the pod") -> None:
    """Validate ``pod`` (a ``V1Pod`` or camelCase dict) strict against the Kubernetes schema;
    raises ConfigError naming the field and the fix."""
    import kubernetes_validate
    from kubernetes.client import ApiClient

    parse_kubernetes_version(kubernetes_version)
    manifest = pod if isinstance(pod, dict) else ApiClient().sanitize_for_serialization(pod)
    try:
        kubernetes_validate.validate(manifest, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ConfigError(
            f"{what} is not a valid Kubernetes {kubernetes_version} Pod at {where}: {e.message}. "
            "Fix the operator argument (or the pod_mutation_hook in airflow_local_settings) that "
            "sets it; strict validation also rejects unknown fields") from None


def apply_placement(manifest: dict[str, Any], fields: Mapping[str, Any]) -> None:
    """Merge :meth:`cairn.policy.CapacityOption.pod_fields` (without ``affinity``, which the
    transform ANDs into existing terms) into a pod manifest, in place. The option's node selector
    and priority class win over the operator's (the log says so); tolerations are added."""
    spec = manifest.setdefault("spec", {})
    selector = dict(spec.get("nodeSelector") or {})
    for k, v in (fields.get("nodeSelector") or {}).items():
        if k in selector and selector[k] != v:
            log.warning("cairn placement: nodeSelector %s=%s replaces %s", k, v, selector[k])
        selector[k] = v
    if selector:
        spec["nodeSelector"] = selector
    tolerations = list(spec.get("tolerations") or [])
    for t in fields.get("tolerations") or []:
        if t not in tolerations:
            tolerations.append(dict(t))
    if tolerations:
        spec["tolerations"] = tolerations
    priority = fields.get("priorityClassName")
    if priority:
        if spec.get("priorityClassName") not in (None, priority):
            log.warning("cairn placement: priorityClassName %s replaces %s", priority,
                        spec["priorityClassName"])
        spec["priorityClassName"] = priority
    if fields.get("labels"):
        manifest.setdefault("metadata", {}).setdefault("labels", {}).update(fields["labels"])


# -- the pod_mutation_hook point -----------------------------------------------------------------

_PENDING: contextvars.ContextVar[Callable[[Any], None] | None] = contextvars.ContextVar(
    "cairn_pod_transform", default=None)


class _TransformFirst:
    """An Airflow policy plugin whose ``pod_mutation_hook`` runs before every other one
    (``tryfirst``; ``airflow_local_settings`` hooks are plain implementations) and does nothing
    unless a CairnKubernetesPodOperator in this context is building its pod."""

    @staticmethod
    @hookimpl(tryfirst=True)
    def pod_mutation_hook(pod: Any) -> None:
        fn = _PENDING.get()
        if fn is not None:
            fn(pod)


def _register_policy() -> None:
    from airflow.settings import get_policy_plugin_manager

    manager = get_policy_plugin_manager()
    if manager.get_plugin(POLICY_PLUGIN_NAME) is None:
        manager.register(_TransformFirst, name=POLICY_PLUGIN_NAME)


@contextmanager
def _transform_first(fn: Callable[[Any], None]) -> Iterator[None]:
    _register_policy()
    token = _PENDING.set(fn)
    try:
        yield
    finally:
        _PENDING.reset(token)


# -- the operator --------------------------------------------------------------------------------

@dataclass(frozen=True)
class PodPlan:
    """What one try's pod gets from cairn: computed before the pod is built."""

    store: StoreConfig
    key: Any
    every: str
    placement: Any = None  # cairn.policy.Placement
    image: str | None = None  # the pinned image, when a previous try recorded its digest
    resume: Any = None  # cairn.Try: this try's plan (None on a dry run without a task instance)
    committed_seq: int | None = None  # what the task state store keeps (ADR 0049)


class CairnKubernetesPodOperator(SuspendDeferral, SerializesCairnConnection,
                                 KubernetesPodOperator):
    """A KubernetesPodOperator whose pod resumes from cairn snapshots on retry (see the module
    docstring for the contract of one try).

    :param mode: ``"process"`` (``cairn run`` around ``cmds``/``arguments``; CRIU; needs
        ``cmds``) or ``"state"`` (the code calls ``cairn.Checkpointer.from_env()``).
    :param sidecar_image: the cairn sidecar image, pinned by tag or digest.
    :param every: snapshot interval of ``cairn run`` (``"10m"``); with ``placement=``, the
        decision's interval is used instead.
    :param final_snapshot_s: measured cost of a final snapshot (sizes the grace period).
    :param grace_cap_s: what the platform gives a preempted pod (GKE spot: 15).
    :param state_bytes, gpu_memory_bytes, staging_bytes, staging: size the staging volume
        (see :func:`cairn.k8s.with_snapshot_sidecar`).
    :param placement: capacity options (:class:`cairn.policy.CapacityOption`) to choose from for
        each new pod; ``deadline`` (aware datetime or epoch seconds) and ``policy_settings``
        (:class:`cairn.policy.PolicySettings`) tune the choice.
    :param kubernetes_version: the cluster's version the final pod is validated against (>= 1.29).
    :param cairn_conn_id: the ``cairn`` connection naming the store.
    :param store_url: the store, overriding the connection.
    :param transform_options: more keyword arguments for ``with_snapshot_sidecar``
        (``on_gce``, ``watch_node_label``, ``grace_margin_s``, ``metrics_port``, ...).
    (The resume options: :data:`cairn_airflow.resume.RESUME_PARAMS_DOC`.)
    """

    template_fields: Sequence[str] = (*KubernetesPodOperator.template_fields, "every")
    ui_color = "#b8c8a8"

    def __init__(self, *, sidecar_image: str, mode: str = "process", every: str = "10m",
                 final_snapshot_s: float | None = None, grace_cap_s: float | None = None,
                 state_bytes: int | str | None = None, gpu_memory_bytes: int | str | None = None,
                 staging_bytes: int | str | None = None, staging: str = "memory",
                 placement: Sequence[Any] | None = None, deadline: datetime | float | None = None,
                 policy_settings: Any = None, kubernetes_version: str = "1.29",
                 cairn_conn_id: str = DEFAULT_CONN_ID, store_url: str | None = None,
                 transform_options: Mapping[str, Any] | None = None,
                 resume_on: str = "any_failure", max_error_retries: int | None = None,
                 loop_guard: bool = True, max_preemptions: int = 0,
                 resume_after: Any = None, resume_poll: Any = None, **kwargs: Any) -> None:
        from cairn.k8s import PodMode, Staging, coerce_option

        self.resume_after = optional_seconds(resume_after, "resume_after")
        self.resume_poll = optional_seconds(resume_poll, "resume_poll")
        self.resume_policy = resume_policy(resume_on=resume_on,
                                           max_error_retries=max_error_retries,
                                           loop_guard=loop_guard, max_preemptions=max_preemptions)

        for name in ("reattach_on_restart", "durable"):
            if kwargs.get(name) is False:
                raise ConfigError(f"{name}=False: a retry would start a second pod next to a live "
                                  "one, whose supervisor it then fences; cairn keeps reattaching "
                                  "on (drop the argument)")
            kwargs.pop(name, None)
        super().__init__(**kwargs)
        self.mode = coerce_option(PodMode, mode, "mode").value
        self.staging = coerce_option(Staging, staging, "staging").value
        self.sidecar_image = sidecar_image
        self.every = every
        self.final_snapshot_s = final_snapshot_s
        self.grace_cap_s = grace_cap_s
        self.state_bytes = state_bytes
        self.gpu_memory_bytes = gpu_memory_bytes
        self.staging_bytes = staging_bytes
        self.placement = tuple(placement) if placement else ()
        if self.placement:
            from cairn.policy import check_options

            check_options(self.placement)
        self.deadline = deadline
        self.policy_settings = policy_settings
        self.kubernetes_version = kubernetes_version
        parse_kubernetes_version(kubernetes_version)
        self.cairn_conn_id = cairn_conn_id
        self.store_url = store_url
        self.transform_options = dict(transform_options or {})
        clash = {"store", "key", "mode", "sidecar_image", "container", "every",
                 "avoid_maintenance"} & set(self.transform_options)
        if clash:
            raise ConfigError(f"transform_options must not set {sorted(clash)}: the operator sets "
                              "them (use its own arguments)")
        self._cairn_context: Any = None
        self.cairn_plan: PodPlan | None = None
        self._committed_mirror: Any = None  # rollback.MarkMirror of the running pod

    # -- one try's plan ---------------------------------------------------------------------

    def store_config(self) -> StoreConfig:
        return operator_store_config(store_url=self.store_url, cairn_conn_id=self.cairn_conn_id)

    def _key(self, context: Any) -> Any:
        if context is not None:
            return task_key(context)
        from cairn import Key

        dag_id = self.dag_id if self.has_dag() else "dag"
        return Key((dag_id, self.task_id, "dry-run", "-1"))

    def decide_placement(self, history: Any, key: Any) -> Any:
        """:func:`cairn.policy.decide` over ``placement`` with the step's ``history``."""
        from cairn.policy import PolicySettings, decide

        decision = decide(self.placement, history, deadline=self.deadline,
                          settings=self.policy_settings or PolicySettings())
        log.info("cairn placement for %s: %s", key, decision.reason)
        return decision

    def asked_placement(self, store: StoreConfig, key: Any) -> tuple[str, str] | None:
        """``(option name, who asked)`` when ``key``'s suspension was lifted by a resume
        request that names a placement and no try has started since (``cairn resume
        --placement``): this try goes there. None otherwise, and when the name is not one of
        ``placement`` (the DAG changed since the request was checked; logged)."""
        from cairn import open_store
        from cairn.exceptions import NotFound

        try:
            with scoped_environ(store.env), open_store(store.url, create=False) as opened:
                current = opened.records.suspension(key)
        except NotFound:  # no store yet: the first try creates it
            return None
        # A suspension with a resume is one no try has started after (Store.records.suspension).
        resume = current.resume if current is not None else None
        if resume is None or resume.placement is None:
            return None
        names = [o.name for o in self.placement]
        if resume.placement not in names:
            log.warning("cairn: %s was resumed on placement %r, which this task no longer has "
                        "(its options: %s); placing it by the policy", key, resume.placement,
                        ", ".join(names))
            return None
        return resume.placement, resume.by

    def move_placement(self, history: Any, key: Any, name: str, by: str) -> Any:
        """:func:`cairn.policy.place_as_asked`: the try on option ``name``, as ``by`` asked."""
        from cairn.policy import PolicySettings, place_as_asked

        placement = place_as_asked(self.placement, name, by=by, history=history,
                                   deadline=self.deadline,
                                   settings=self.policy_settings or PolicySettings())
        log.info("cairn placement for %s: %s", key, placement.reason)
        return placement

    def _pinned_image(self, context: Any) -> str | None:
        stored = _state_get(context, IMAGE_STATE_KEY)
        if not isinstance(stored, dict) or not self.image:
            return None
        if stored.get("image") != self.image:
            log.info("cairn: image changed from %s to %s since the first try; not pinning",
                     stored.get("image"), self.image)
            return None
        return pin_image(self.image, str(stored.get("digest")))

    def plan(self, context: Any) -> PodPlan:
        store = self.store_config()
        key = self._key(context)
        this_try = None
        if self.placement or context is not None:  # one read serves placement and resume
            ti = context["ti"] if context is not None else None
            this_try = begin_try(store.url, key, self.resume_policy, env=store.env, check=False,
                                 try_number=getattr(ti, "try_number", None))
        placement = None
        if self.placement:
            history = this_try.history if this_try else None
            asked = self.asked_placement(store, key) if context is not None else None
            placement = (self.decide_placement(history, key) if asked is None
                         else self.move_placement(history, key, *asked))
        every = placement.every if placement is not None else str(self.every)
        resume = this_try if context is not None else None
        if resume is not None:
            refuse_if_given_up(resume)
        return PodPlan(store=store, key=key, every=every, placement=placement,
                       image=self._pinned_image(context), resume=resume,
                       committed_seq=None if context is None
                       else committed.kept_seq(context, store.url, key))

    def cairn_mutation(self, plan: PodPlan) -> Callable[[Any], None]:
        """The in-place change cairn makes to the built pod (before the administrator's hook)."""
        from kubernetes.client import ApiClient

        from cairn.k8s import to_v1pod, with_snapshot_sidecar

        def mutate(pod: Any) -> None:
            manifest = ApiClient().sanitize_for_serialization(pod)
            spec = manifest.setdefault("spec", {})
            main = next((c for c in spec.get("containers") or []
                         if c.get("name") == self.base_container_name), None)
            if main is None:
                raise ConfigError(f"the pod has no container {self.base_container_name!r}")
            if plan.image:
                log.info("cairn: pinning the image to the first try's %s", plan.image)
                main["image"] = plan.image
            avoid = False
            if plan.placement is not None:
                fields = dict(plan.placement.option.pod_fields())
                apply_placement(manifest, fields)
                avoid = plan.placement.avoid_maintenance
                env = main.setdefault("env", [])
                names = {e.get("name") for e in env}
                env.extend({"name": k, "value": v} for k, v in plan.placement.env().items()
                           if k not in names)
            extra_env = dict(plan.store.env)
            if plan.resume is not None and plan.resume.exclude:
                from cairn.runtime import env as contract

                extra_env[contract.EXCLUDE_SEQS.name] = contract.format_seqs(plan.resume.exclude)
            if extra_env:
                env = main.setdefault("env", [])
                names = {e.get("name") for e in env}
                env.extend({"name": k, "value": v} for k, v in extra_env.items()
                           if k not in names)
            out = with_snapshot_sidecar(
                manifest, store=plan.store.url, key=str(plan.key), mode=self.mode,
                sidecar_image=self.sidecar_image, container=self.base_container_name,
                every=plan.every, final_snapshot_s=self.final_snapshot_s,
                grace_cap_s=self.grace_cap_s, state_bytes=self.state_bytes,
                gpu_memory_bytes=self.gpu_memory_bytes, staging_bytes=self.staging_bytes,
                staging=self.staging, avoid_maintenance=avoid, committed_in_pod=True,
                **self.transform_options)
            if plan.committed_seq is not None:
                # The sidecar copies it into the pod's files before the main container starts.
                from cairn.k8s import COMMITTED_SEQS_ANNOTATION

                out.setdefault("metadata", {}).setdefault("annotations", {})[
                    COMMITTED_SEQS_ANNOTATION] = committed.seed_for_pod(
                        plan.store.url, plan.key, plan.committed_seq)
            done = to_v1pod(out)
            pod.metadata, pod.spec = done.metadata, done.spec

        return mutate

    # -- KubernetesPodOperator hook points ----------------------------------------------------

    def build_pod_request_obj(self, context: Any = None, *, dry_run: bool = False) -> Any:
        """The KubernetesPodOperator's pod with cairn's transform applied first in the
        ``pod_mutation_hook`` chain, validated strict after the whole chain."""
        plan = self.cairn_plan = self.plan(context)
        ran: list[bool] = []
        mutate = self.cairn_mutation(plan)

        def once(pod: Any) -> None:
            if not ran:  # a hook chain that runs twice must not wrap `cairn run` twice
                mutate(pod)
                ran.append(True)

        with _transform_first(once):
            pod = super().build_pod_request_obj(context, dry_run=dry_run)
        if not ran:
            raise ConfigError("the KubernetesPodOperator built its pod without calling "
                              "pod_mutation_hook, so cairn's transform did not run; this cncf "
                              "provider version is not supported (pin the one in "
                              "providers/cairn_airflow/constraints.txt)")
        validate_pod(pod, kubernetes_version=self.kubernetes_version,
                     what=f"the pod of task {self.task_id!r}")
        return pod

    def execute(self, context: Any) -> Any:
        self._cairn_context = context
        return super().execute(context)

    def await_pod_start(self, pod: Any) -> None:
        super().await_pod_start(pod)
        try:
            self.record_image_digest(self._cairn_context, self.pod_manager.read_pod(pod))
        except Exception as e:  # noqa: BLE001 - pinning is best effort; the try goes on
            log.warning("cairn: could not record the image digest: %s", e)
        self._watch_committed(pod)

    def _watch_committed(self, pod: Any) -> None:
        """Keep what the pod's annotation records in the task state store while it runs."""
        from cairn.runtime.rollback import MarkMirror

        context, plan = self._cairn_context, self.cairn_plan
        accessor = context.get("task_state_store") if context is not None else None
        if accessor is None or plan is None:
            return
        kept = committed.PodKeptSeq(lambda: self.pod_manager.read_pod(pod), plan.store.url,
                                    plan.key)
        mirror = MarkMirror(kept, lambda entry: accessor.set(committed.TASK_STATE_KEY, entry),
                            published=plan.committed_seq, poll_s=committed.POD_POLL_S)
        if committed.comms_take_threads():
            mirror.start()
        self._committed_mirror = mirror

    def _keep_committed(self, context: Any, remote_pod: Any) -> None:
        """Once the pod has ended: the newest seq its annotation keeps, in the task state
        store (after the sidecar's last publish; ADR 0049)."""
        accessor = context.get("task_state_store") if context is not None else None
        mirror, self._committed_mirror = self._committed_mirror, None
        if mirror is not None and mirror.is_alive():
            mirror.stop()
        if accessor is None:
            return
        plan = self.cairn_plan
        url = plan.store.url if plan is not None else self.store_config().url
        key = plan.key if plan is not None else task_key(context)
        kept = committed.PodKeptSeq(lambda: self.pod_manager.read_pod(remote_pod), url, key)
        try:
            seq = committed.final_seq_from_pod(kept, remote_pod)
            published = mirror.published if mirror is not None else (
                plan.committed_seq if plan is not None else None)
            if seq is not None and (published is None or seq > published):
                accessor.set(committed.TASK_STATE_KEY, kept.entry(seq))
                log.info("cairn: kept committed seq %d of %s in %s", seq, key, committed.SOURCE)
        except Exception as e:  # noqa: BLE001 - the try's result stands; say what is lost
            log.warning("cairn: could not keep the pod's committed seq in %s (%s): the next "
                        "pod cannot tell whether its snapshots were deleted", committed.SOURCE,
                        e)

    def record_image_digest(self, context: Any, remote_pod: Any) -> str | None:
        """Keep the first pod's image digest for later tries (a no-op once one is kept)."""
        if _state_get(context, IMAGE_STATE_KEY) is not None or not self.image:
            return None
        digest = image_digest_from_pod(remote_pod, self.base_container_name)
        if digest is None:
            log.info("cairn: the pod's imageID has no repository digest; retries are not pinned")
            return None
        store = context.get("task_state_store") if context is not None else None
        if store is None:
            log.info("cairn: no task state store (Airflow < 3.3): retries are not pinned")
            return None
        store.set(IMAGE_STATE_KEY, {"image": self.image, "digest": digest})
        log.info("cairn: retries of this task run %s", pin_image(self.image, digest))
        return digest

    def cleanup(self, pod: Any, remote_pod: Any, xcom_result: dict | None = None,
                context: Any = None) -> None:
        """Airflow's cleanup; a failure that cairn's exit codes or the pod status explain is
        raised as :class:`Preempted`, :class:`Fenced` or ``AirflowFailException`` instead."""
        if remote_pod is not None:
            self._keep_committed(context if context is not None else self._cairn_context,
                                 remote_pod)
        if remote_pod is not None and self.cairn_plan is not None:
            self._record_outcome(remote_pod)
        from airflow.providers.common.compat.sdk import AirflowException

        try:
            super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result,
                            context=context)
        except AirflowException as e:
            # Only Airflow's "the pod failed" verdict (a plain AirflowException) is re-read;
            # its subclasses (API errors, skips, credential expiry) mean something else.
            if type(e) is not AirflowException or remote_pod is None:
                raise
            mapped = pod_end_error(remote_pod, self.base_container_name)
            plan = self.cairn_plan
            from cairn.exceptions import Suspended
            from cairn_airflow.resume import refuse_restore_failure

            context = context if context is not None else self._cairn_context
            if isinstance(mapped, Suspended) and (plan is not None or context is not None):
                # The pod is deleted by now (or kept, as on_finish_action says): nothing runs
                # while the task waits. The continuation builds a new pod. Without a plan (the
                # KPO's own deferrable mode resumed on another worker) the key and store are
                # those of the task.
                store = plan.store if plan is not None else self.store_config()
                self.defer_suspended(context, store_url=store.url,
                                     key=plan.key if plan is not None else task_key(context),
                                     env=store.env)
                raise mapped from e  # the key was discarded meanwhile: a retry starts fresh
            if plan is not None and plan.resume is not None:
                ended = mapped or e  # the pod's outcome is recorded by _record_outcome
                raise_verdict(plan.resume, plan.resume.ended(error=ended), ended,
                              delay=self.retry_delay)
            if mapped is None:
                raise
            refuse_restore_failure(mapped)  # exit 8 or 9: fails without a retry
            raise mapped from e

    def _record_outcome(self, remote_pod: Any) -> None:
        plan = self.cairn_plan
        assert plan is not None
        try:
            from cairn import open_store

            with scoped_environ(plan.store.env), open_store(plan.store.url, create=False) as store:
                outcome = record_pod_outcome(store, plan.key, remote_pod,
                                             self.base_container_name, placement=plan.placement)
            if outcome is not None:
                log.info("cairn: recorded try %d of %s as %s (from the pod status)",
                         outcome.epoch, plan.key, outcome.outcome.value)
        except Exception as e:  # noqa: BLE001 - an outcome is advice; never change the result
            log.warning("cairn: could not record the pod's outcome: %s", e)

    def on_kill(self) -> None:
        """Airflow's kill deletes the pod: the kubelet then sends SIGTERM to ``cairn run``, which
        takes its final snapshot within the pod's grace. That grace (sized by the transform for
        the final snapshot) is passed to the deletion instead of a shorter one set on the
        operator. Returns once the API server accepted the deletion."""
        spec = getattr(self.pod, "spec", None)
        grace = getattr(spec, "termination_grace_period_seconds", None)
        if grace is not None and self.termination_grace_period is not None and \
                self.termination_grace_period < grace:
            self.termination_grace_period = grace
        super().on_kill()


def _state_get(context: Any, key: str) -> Any:
    store = context.get("task_state_store") if context is not None else None
    if store is None:
        return None
    return store.get(key)


CairnKubernetesPodOperator.__doc__ = with_resume_params(CairnKubernetesPodOperator.__doc__)
