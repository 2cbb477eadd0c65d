"""``with_snapshot_sidecar``: a pure pod-spec transform that puts a step under cairn.

It takes a Pod, a Job (batch/v1) or a JobSet (jobset.x-k8s.io/v1alpha2): a plain manifest dict,
camelCase as in YAML, or a ``kubernetes.client.V1Pod`` / ``V1Job``, and returns a new one of the
same kind; the input is never modified. A Job's pod template (each replicated Job's, for a
JobSet) is transformed, and each pod's key is (namespace, Job, completion index), built in the
pod from the downward API (ADR 0028). What it does, and why,
is in docs/kubernetes.md and docs/adr/0010-k8s-notice-channel-and-pod-transform.md:

* the main container runs under ``cairn run`` (process mode), or gets ``CAIRN_STORE``,
  ``CAIRN_KEY``, ``CAIRN_NOTICE_FILE`` and ``CAIRN_STATUS_FILE`` for
  ``Checkpointer.from_env()`` (state mode);
* a native sidecar (an ``initContainers`` entry with ``restartPolicy: Always``) runs
  ``cairn sidecar``: notices and metrics, small requests, non-root, no checkpointing; in
  process mode it also uploads (``--upload``): ``cairn run`` hands each dump to it through the
  spool on the shared volume (``CAIRN_SPOOL_DIR``, ADR 0014), and it gets the store's
  credentials settings from the main container;
* one shared ``emptyDir`` carries the notice and status files and, in process mode, CRIU's
  staging and the spool (one dump at a time); memory-backed, its size is added to the main
  container's memory request and limit, and so is the GPU memory the CUDA driver copies into
  host RAM before a dump;
* ``terminationGracePeriodSeconds`` covers the measured final-snapshot cost plus a margin;
* process mode gets the security settings measured in ADR 0008; state mode needs none;
* optionally a node affinity that keeps the pod off nodes with scheduled maintenance.

Its one job is that pod spec, step by step (``_transform_pod``). Elsewhere: a Job's and a
JobSet's templates and keys (:mod:`cairn.k8s.job_templates`), what the sidecar needs to reach
the store (:mod:`cairn.k8s.store_access`), the grants its watchers need (:mod:`cairn.k8s.rbac`),
the committed seqs a Job's annotation keeps (:mod:`cairn.k8s.committed`).
"""

from __future__ import annotations

import copy
import enum
import json
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime import channel, env
from cairn.runtime.choices import coerce_option
from cairn.k8s.committed import pod_settings as committed_seq_settings
from cairn.k8s.job_templates import (
    JOB_API_VERSION,
    JOB_ENV,
    JOBSET_API_VERSION,
    NAMESPACE_ENV,
    check_api_version,
    manifest_name,
    transform_job,
    transform_jobset,
)
from cairn.k8s.quantity import format_bytes, parse_bytes, round_up_mib
from cairn.k8s.rbac import DNS_NAME
from cairn.k8s.store_access import check_store, uploader_access
from cairn.k8s.watchers import MAINTENANCE_LABEL
from cairn.store.keys import Key

SIDECAR_NAME = "cairn-sidecar"
VOLUME_NAME = "cairn-shared"
SHARED_PATH = "/var/run/cairn"
METRICS_PORT = 9464
DEFAULT_GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds
GKE_SPOT_GRACE_S = 15.0  # what GKE's graceful node shutdown gives a pod on spot reclaim
SIDECAR_UID = 65532
# CRIU's images hold the resident memory plus what the CUDA driver moved off the GPU; the
# pagemap and core images add a little on top.
STAGING_HEADROOM = 1.10
CHANNEL_ONLY_BYTES = 16 << 20
# State mode stages a copy of the state in a memfd buffer sized to the state plus 1/8 (ADR 0006),
# charged to the container's memory.
STATE_STAGING_FACTOR = 1.125
# ADR 0008: the measured set on top of the runtime's default capabilities.
PROCESS_CAPABILITIES = ("SYS_ADMIN", "SYS_TIME", "NET_ADMIN", "SYS_PTRACE")
# Kept from the runtime default set; named explicitly when the container drops ALL.
PROCESS_DEFAULT_CAPABILITIES = ("SETPCAP", "SYS_CHROOT")
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
GPU_RESOURCE = "nvidia.com/gpu"
SPOOL_PATH = f"{SHARED_PATH}/spool"
# Every store's secret file (encrypted stores); the uploading sidecar must read it too.
SECRET_VOLUME_NAME = "cairn-secret"
SECRET_DIR = "/var/run/cairn-secret"
SECRET_FILE_NAME = "cairn.secret"
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")
# Jobs and JobSets (ADR 0028): a Job pod's key is (namespace, Job, completion index), known only
# in the pod, so it is built from the downward API and Kubernetes' $(VAR) expansion.
SIDECAR_RESOURCES = {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}}
# Uploading hashes and sends every dump (cairn.k8s.uploader keeps two 16 MiB packs in flight).
UPLOADER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"},
                      "limits": {"memory": "512Mi"}}


class PodMode(str, enum.Enum):
    """How the main container is snapshotted."""

    PROCESS = "process"  # `cairn run -- CMD`: CRIU, needs the privileges of ADR 0008
    STATE = "state"  # `cairn.Checkpointer.from_env()` in the user's code: runs anywhere


class Staging(str, enum.Enum):
    """What backs the shared volume."""

    MEMORY = "memory"  # tmpfs: fastest dumps; counts against the memory limit
    DISK = "disk"  # node disk: slower dumps; counts against ephemeral storage


class GraceWarning(UserWarning):
    """The final snapshot needs more time than the platform gives a preempted pod."""


# -- V1Pod <-> dict ----------------------------------------------------------------------------

def _as_manifest(obj: object) -> tuple[dict[str, Any], str | None]:
    """A deep copy of ``obj`` as a camelCase dict, and the ``kubernetes`` client model it was
    (``"V1Pod"``, ``"V1Job"``; None for a dict)."""
    if isinstance(obj, dict):
        return copy.deepcopy(obj), None
    try:
        from kubernetes.client import ApiClient, V1Job, V1Pod
    except ImportError:
        V1Pod = V1Job = None  # noqa: N806
    for model in (V1Pod, V1Job):
        if model is not None and isinstance(obj, model):
            return copy.deepcopy(ApiClient().sanitize_for_serialization(obj)), model.__name__
    raise ConfigError(f"with_snapshot_sidecar takes a Pod, a Job or a JobSet as a dict (or a "
                      f"kubernetes.client.V1Pod / V1Job), not {type(obj).__name__}")


def to_v1pod(manifest: dict[str, Any]) -> Any:
    """A camelCase pod manifest as the ``kubernetes`` client's ``V1Pod``."""
    return _to_model(manifest, "V1Pod")


def _to_model(manifest: dict[str, Any], model: str) -> Any:
    from kubernetes.client import ApiClient

    text = json.dumps(manifest)
    client = ApiClient()
    try:
        return client.deserialize(text, model, "application/json")
    except TypeError:  # clients before 35 take a response object
        class _Response:
            data = text

        return client.deserialize(_Response(), model)  # type: ignore[call-arg]


# -- helpers -----------------------------------------------------------------------------------

def _find_container(spec: dict[str, Any], name: str | None) -> dict[str, Any]:
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise ConfigError("the pod has no spec.containers; pass a Pod, a Job or a JobSet "
                          "manifest with its containers")
    names = [c.get("name") for c in containers]
    if name is None:
        if len(containers) > 1:
            raise ConfigError(f"the pod has containers {names}; say which runs the step with "
                              "container=NAME")
        return containers[0]
    for c in containers:
        if c.get("name") == name:
            return c
    raise ConfigError(f"no container named {name!r}; the pod has {names}")


def _all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _add_memory(container: dict[str, Any], extra: int) -> None:
    """Raise the memory request and limit by ``extra`` bytes, where they are set."""
    if extra <= 0:
        return
    resources = container.setdefault("resources", {})
    for section in ("requests", "limits"):
        values = resources.get(section)
        if values and "memory" in values:
            current = parse_bytes(values["memory"], what=f"{section}.memory")
            values["memory"] = format_bytes(current + extra)


def _merge_env(container: dict[str, Any], values: dict[str, str]) -> None:
    env = container.setdefault("env", [])
    existing = {e.get("name"): e for e in env}
    for name, value in values.items():
        if name in existing:
            if existing[name].get("value") != value:
                raise ConfigError(f"container {container.get('name')!r} already sets {name}="
                                  f"{existing[name].get('value')!r}; remove it or pass that "
                                  "value")
            continue
        env.append({"name": name, "value": value})


def _process_security(spec: dict[str, Any], container: dict[str, Any],
                      metadata: dict[str, Any]) -> None:
    """ADR 0008's settings on the container that runs ``cairn run``."""
    name = container["name"]
    pod_sc = spec.get("securityContext") or {}
    sc = container.setdefault("securityContext", {})
    if sc.get("runAsNonRoot") or (pod_sc.get("runAsNonRoot") and "runAsUser" not in sc):
        raise ConfigError(f"container {name!r} (or the pod) sets runAsNonRoot: CRIU in process "
                          "mode runs as root; remove runAsNonRoot, or use mode='state'")
    if sc.get("allowPrivilegeEscalation") is False:
        raise ConfigError(f"container {name!r} sets allowPrivilegeEscalation: false, which the "
                          "API rejects together with CAP_SYS_ADMIN (ADR 0008); remove it")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser", 0))
    if uid != 0:
        raise ConfigError(f"container {name!r} runs as uid {uid}; process mode runs CRIU as "
                          "root (runAsUser: 0)")
    sc["runAsUser"] = 0
    sc["seccompProfile"] = {"type": "Unconfined"}  # any filter stops the dump (ADR 0008)
    caps = sc.setdefault("capabilities", {})
    drop = list(caps.get("drop") or [])
    blocked = [c for c in drop if c in PROCESS_CAPABILITIES + PROCESS_DEFAULT_CAPABILITIES]
    if blocked:
        raise ConfigError(f"container {name!r} drops {blocked}, which CRIU needs (ADR 0008); "
                          "remove them from capabilities.drop")
    add = list(caps.get("add") or [])
    wanted = list(PROCESS_CAPABILITIES)
    if "ALL" in drop:
        wanted += PROCESS_DEFAULT_CAPABILITIES
    caps["add"] = add + [c for c in wanted if c not in add]
    # The annotation, not securityContext.appArmorProfile: the field is 1.30+, the annotation
    # is honoured from 1.29 on (and mirrored into the field by newer API servers).
    metadata.setdefault("annotations", {})[APPARMOR_ANNOTATION + name] = "unconfined"


def _share_volume_group(spec: dict[str, Any]) -> None:
    """The shared volume belongs to one group both containers are in (the pod's ``fsGroup``;
    the sidecar's own group unless the pod sets one), so the spool and the channel files are
    group-readable only, never world-readable (docs/security.md). ``OnRootMismatch``: the
    kubelet re-chowns a volume only when its root is not the group's yet, not at every start."""
    pod_sc = spec.setdefault("securityContext", {})
    pod_sc.setdefault("fsGroup", SIDECAR_UID)
    pod_sc.setdefault("fsGroupChangePolicy", "OnRootMismatch")


def _avoid_maintenance(spec: dict[str, Any]) -> None:
    """AND "no scheduled maintenance" into every required node selector term (terms are ORed,
    expressions within one are ANDed)."""
    expression = {"key": MAINTENANCE_LABEL, "operator": "DoesNotExist"}
    required = (spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
                .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}))
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        expressions = term.setdefault("matchExpressions", [])
        if expression not in expressions:
            expressions.append(dict(expression))


def _sidecar(*, image: str, port: int, grace_s: int, preemption_window_s: float,
             on_gce: bool, watch_node_label: bool, image_pull_policy: str | None,
             upload_to: tuple[str, str] | None = None) -> dict[str, Any]:
    args = ["sidecar", "--shared", SHARED_PATH, "--port", str(port),
            "--sigterm-window", f"{grace_s}s",
            "--preemption-window", f"{preemption_window_s:g}s"]
    if not on_gce:
        args.append("--no-metadata")
    if watch_node_label:
        args.append("--watch-node-label")
    if upload_to is not None:
        args += ["--upload", "--spool", SPOOL_PATH, "--store", upload_to[0],
                 "--key", upload_to[1]]
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": image,
        "command": ["cairn"],
        "args": args,
        "restartPolicy": "Always",  # a native sidecar: up before, and after, the main container
        "ports": [{"name": "cairn-metrics", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": port},
                           "periodSeconds": 10, "failureThreshold": 3},
        "resources": copy.deepcopy(UPLOADER_RESOURCES if upload_to else SIDECAR_RESOURCES),
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": SIDECAR_UID, "runAsGroup": SIDECAR_UID,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": VOLUME_NAME, "mountPath": SHARED_PATH}],
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    if watch_node_label:
        container["env"] = [{"name": "NODE_NAME",
                             "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    return container


def _seconds(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what}={value!r} must be a number of seconds, zero or more")
    return float(value)


def _size(value: int | str | None, what: str) -> int | None:
    return None if value is None else parse_bytes(value, what=what)


# -- Jobs and JobSets -------------------------------------------------------------------------

def _prepend_env(container: dict[str, Any], values: list[dict[str, Any]]) -> None:
    """Put ``values`` first in the container's env, so later values can use them as $(VAR)."""
    env_list = container.setdefault("env", [])
    taken = {e.get("name") for e in env_list}
    clash = [v["name"] for v in values if v["name"] in taken]
    if clash:
        raise ConfigError(f"container {container.get('name')!r} already sets {clash}, which "
                          "cairn sets from the downward API to build a Job pod's key; remove them")
    env_list[:0] = copy.deepcopy(values)


@dataclass(frozen=True, kw_only=True)
class _PodPlan:
    """:func:`with_snapshot_sidecar`'s options, checked: what each pod of the manifest gets."""

    mode: PodMode
    store: str
    container: str | None
    every: str
    final_s: float | None
    margin_s: float | None
    cap_s: float | None
    state_n: int | None
    gpu_n: int
    staging_n: int | None
    staging: Staging
    sidecar_image: str
    metrics_port: int
    on_gce: bool
    watch_node_label: bool
    image_pull_policy: str | None
    avoid_maintenance: bool
    secret_name: str | None
    secret_key: str
    committed_in_pod: bool


def _transform_pod(plan: _PodPlan, manifest: dict[str, Any], pod_key: str,
                   key_env: list[dict[str, Any]]) -> None:
    """Put one pod (or pod template) under cairn, in place; ``key_env``: the variables
    ``pod_key`` expands (the main container and the sidecar get them first)."""
    metadata = manifest.setdefault("metadata", {})
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        raise ConfigError("the pod has no spec")
    main = _find_container(spec, plan.container)
    _refuse_transformed(spec, plan.metrics_port)
    argv = _process_command(plan, spec, main) if plan.mode is PodMode.PROCESS else []
    staging_n = _staging_bytes(plan, main)
    grace = _grace(plan, spec)
    _mount_shared(plan, spec, main, staging_n)
    _run_under_cairn(plan, spec, metadata, main, pod_key=pod_key, grace=grace, argv=argv)
    _attach_sidecar(plan, spec, main, pod_key=pod_key, grace=grace, key_env=key_env)


def _refuse_transformed(spec: dict[str, Any], metrics_port: int) -> None:
    """Idempotence is refused rather than guessed at: a second pass would wrap `cairn run`
    twice; and nothing of the pod's may take the sidecar's names, path or port."""
    if any(c.get("name") == SIDECAR_NAME for c in _all_containers(spec)):
        raise ConfigError(f"the pod already has a container named {SIDECAR_NAME!r}: it was "
                          "transformed already")
    if any(v.get("name") == VOLUME_NAME for v in spec.get("volumes") or []):
        raise ConfigError(f"the pod already has a volume named {VOLUME_NAME!r}; rename it")
    for c in _all_containers(spec):
        if any(m.get("mountPath") == SHARED_PATH for m in c.get("volumeMounts") or []):
            raise ConfigError(f"container {c.get('name')!r} already mounts {SHARED_PATH}")
        if any(p.get("containerPort") == metrics_port for p in c.get("ports") or []):
            raise ConfigError(f"container {c.get('name')!r} already uses port {metrics_port}; "
                              "pass another metrics_port=")


def _gpus(main: dict[str, Any]) -> Any:
    return ((main.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE)


def _process_command(plan: _PodPlan, spec: dict[str, Any], main: dict[str, Any]) -> list[str]:
    """Process mode: the command ``cairn run`` wraps, after checking it can."""
    name = main.get("name")
    if spec.get("shareProcessNamespace"):
        raise ConfigError("process mode needs the main container in its own PID namespace "
                          "(CRIU restores exact PIDs): remove shareProcessNamespace")
    if plan.every not in ("0", "never"):
        from cairn.runtime.durations import parse_duration

        parse_duration(plan.every)  # raises ConfigError naming the accepted forms
    argv = list(main.get("command") or []) + list(main.get("args") or [])
    if not main.get("command"):
        raise ConfigError(f"container {name!r} has no command: process mode wraps it in "
                          "`cairn run -- CMD`, and the image's ENTRYPOINT is not in the pod "
                          "spec; set command (and args) explicitly")
    if argv[:2] == ["cairn", "run"]:
        raise ConfigError(f"container {name!r} already runs `cairn run`; pass the bare command")
    gpus = _gpus(main)
    if gpus not in (None, 0, "0") and not plan.gpu_n:
        raise ConfigError(f"container {name!r} asks for {gpus} {GPU_RESOURCE}: give "
                          "gpu_memory_bytes= (the GPU memory the job uses, all GPUs), which "
                          "the driver copies into host RAM before a dump")
    return argv


def _staging_bytes(plan: _PodPlan, main: dict[str, Any]) -> int:
    """The shared volume's size: a process image's staging, or the channel files only."""
    staging_n = plan.staging_n
    if plan.mode is PodMode.PROCESS:
        if staging_n is None:
            if plan.state_n is None:
                raise ConfigError("give staging_bytes= (the staging volume's size) or "
                                  "state_bytes= (the workload's resident memory) to size it")
            staging_n = round_up_mib(int((plan.state_n + plan.gpu_n) * STAGING_HEADROOM))
    elif staging_n is None:
        staging_n = CHANNEL_ONLY_BYTES  # state mode: the volume carries only the channel files
    return round_up_mib(max(staging_n, CHANNEL_ONLY_BYTES))


def _grace(plan: _PodPlan, spec: dict[str, Any]) -> int:
    """At least the final snapshot plus a margin, never less than what was set."""
    current = spec.get("terminationGracePeriodSeconds")
    grace = int(current) if current is not None else DEFAULT_GRACE_S
    final_s, margin_s, cap_s = plan.final_s, plan.margin_s, plan.cap_s
    if final_s is not None:
        needed = int(math.ceil(final_s + (margin_s or 0.0)))
        grace = max(grace, needed)
        if cap_s is not None and needed > cap_s:
            warnings.warn(GraceWarning(
                f"the final snapshot needs {needed}s (measured {final_s:g}s + {margin_s:g}s "
                f"margin) but the platform gives a preempted pod {cap_s:g}s (GKE spot: "
                f"{GKE_SPOT_GRACE_S:g}s): on preemption the last periodic snapshot is what "
                f"resumes; snapshot more often (every=) or use on-demand nodes"), stacklevel=5)
    spec["terminationGracePeriodSeconds"] = grace
    return grace


def _mount_shared(plan: _PodPlan, spec: dict[str, Any], main: dict[str, Any],
                  staging_n: int) -> None:
    """The shared volume (and the secret's), and what a memory-backed one costs the main
    container."""
    volume: dict[str, Any] = {"name": VOLUME_NAME,
                              "emptyDir": {"sizeLimit": format_bytes(staging_n)}}
    if plan.staging is Staging.MEMORY:
        volume["emptyDir"]["medium"] = "Memory"
    spec.setdefault("volumes", []).append(volume)
    main.setdefault("volumeMounts", []).append({"name": VOLUME_NAME, "mountPath": SHARED_PATH})
    if plan.secret_name is not None:
        if any(v.get("name") == SECRET_VOLUME_NAME for v in spec["volumes"]):
            raise ConfigError(f"the pod already has a volume named {SECRET_VOLUME_NAME!r}")
        spec["volumes"].append({"name": SECRET_VOLUME_NAME, "secret": {
            "secretName": plan.secret_name, "defaultMode": 0o440,
            "items": [{"key": plan.secret_key, "path": SECRET_FILE_NAME}]}})
        main["volumeMounts"].append({"name": SECRET_VOLUME_NAME, "mountPath": SECRET_DIR,
                                     "readOnly": True})
        _merge_env(main, {env.SECRET_FILE.name: f"{SECRET_DIR}/{SECRET_FILE_NAME}"})
    extra_memory = (staging_n if plan.staging is Staging.MEMORY else 0)
    if plan.mode is PodMode.PROCESS:
        extra_memory += plan.gpu_n
    elif plan.state_n:
        extra_memory += round_up_mib(int(math.ceil(plan.state_n * STATE_STAGING_FACTOR)))
    _add_memory(main, extra_memory)


def _run_under_cairn(plan: _PodPlan, spec: dict[str, Any], metadata: dict[str, Any],
                     main: dict[str, Any], *, pod_key: str, grace: int,
                     argv: list[str]) -> None:
    """Process mode: the command wrapped in ``cairn run`` (which only dumps into the spool;
    the sidecar uploads, ADR 0014) with ADR 0008's privileges. State mode: the Checkpointer's
    settings in the environment."""
    notice_file = f"{SHARED_PATH}/{channel.NOTICE_NAME}"
    status_file = f"{SHARED_PATH}/{channel.STATUS_NAME}"
    if plan.mode is PodMode.PROCESS:
        main["command"] = ["cairn", "run", "--store", plan.store, "--key", pod_key,
                           "--every", plan.every, "--grace", f"{grace}s",
                           "--workdir", f"{SHARED_PATH}/run",
                           "--notice-file", notice_file, "--status-file", status_file,
                           "--", *argv]
        main.pop("args", None)
        _merge_env(main, {env.SPOOL_DIR.name: SPOOL_PATH})
        _process_security(spec, main, metadata)
    else:
        _merge_env(main, {env.STORE.name: plan.store, env.KEY.name: pod_key,
                          env.NOTICE_FILE.name: notice_file, env.STATUS_FILE.name: status_file})


def _attach_sidecar(plan: _PodPlan, spec: dict[str, Any], main: dict[str, Any], *,
                    pod_key: str, grace: int, key_env: list[dict[str, Any]]) -> None:
    """The native sidecar first among the init containers, with what it needs."""
    window = grace if plan.cap_s is None else min(float(grace), plan.cap_s)
    sidecar = _sidecar(
        image=plan.sidecar_image, port=plan.metrics_port, grace_s=grace,
        preemption_window_s=window, on_gce=plan.on_gce, watch_node_label=plan.watch_node_label,
        image_pull_policy=plan.image_pull_policy,
        upload_to=(plan.store, pod_key) if plan.mode is PodMode.PROCESS else None)
    if plan.mode is PodMode.PROCESS:
        uploader_access(main, sidecar, plan.store)
    _share_volume_group(spec)
    spec.setdefault("initContainers", []).insert(0, sidecar)
    if plan.avoid_maintenance:
        _avoid_maintenance(spec)
    if key_env:
        _prepend_env(main, key_env)
        _prepend_env(sidecar, key_env)
        # A suspended Job's try ends suspended, in both modes, and the Job's annotation keeps
        # the committed seqs across its pods (needs job_reader_rbac).
        sidecar["args"] += ["--owner-job", f"$({NAMESPACE_ENV})/$({JOB_ENV})"]
    elif plan.committed_in_pod:
        # A bare pod whose creator carries its committed seqs to the next pod it makes (the
        # Airflow pod operator): the pod's own annotation keeps them (needs pod_annotator_rbac).
        _prepend_env(sidecar, [
            {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
            for name, path in ((NAMESPACE_ENV, "metadata.namespace"),
                               (env.K8S_POD.name, "metadata.name"))])
        sidecar["args"] += ["--owner-pod", f"$({NAMESPACE_ENV})/$({env.K8S_POD.name})"]
    else:
        return
    # The files on the shared volume, and the main container held back until the sidecar has
    # seeded them from the annotation.
    committed_env, sidecar["startupProbe"] = committed_seq_settings(SHARED_PATH,
                                                                    plan.metrics_port)
    _merge_env(main, committed_env)
    _merge_env(sidecar, committed_env)


# -- the transform -----------------------------------------------------------------------------

def with_snapshot_sidecar(
    pod: Any,
    *,
    store: str,
    key: str | None = None,
    mode: PodMode | str,
    sidecar_image: str,
    container: str | None = None,
    every: str = "10m",
    final_snapshot_s: float | None = None,
    grace_margin_s: float = 10.0,
    grace_cap_s: float | None = None,
    state_bytes: int | str | None = None,
    gpu_memory_bytes: int | str | None = None,
    staging_bytes: int | str | None = None,
    staging: Staging | str = Staging.MEMORY,
    avoid_maintenance: bool = False,
    watch_node_label: bool = False,
    on_gce: bool = True,
    metrics_port: int = METRICS_PORT,
    image_pull_policy: str | None = None,
    secret_name: str | None = None,
    secret_key: str = SECRET_FILE_NAME,
    replicated_jobs: list[str] | tuple[str, ...] | None = None,
    committed_in_pod: bool = False,
) -> Any:
    """A new pod whose ``container`` (default: the only one) runs under cairn.

    ``store``/``key``: where the step's snapshots live and which work they are (``a/b/c``).
    A Job's or JobSet's pods get ``NAMESPACE/JOB/INDEX`` (their completion index; a NonIndexed
    Job must run one pod, index 0); ``key=PREFIX`` makes it ``PREFIX/JOB/INDEX``, and a key
    that uses ``$(CAIRN_K8S_COMPLETION_INDEX)`` (and, for a JobSet, ``$(CAIRN_K8S_JOB)``) is
    taken as it is. ``replicated_jobs``: the JobSet's replicatedJobs to transform (default all).
    ``every``: the snapshot interval of ``cairn run`` (process mode; a state-mode
    Checkpointer keeps its own policy).
    ``final_snapshot_s``: the measured cost of a final snapshot; the grace becomes at least
    that plus ``grace_margin_s``, and a :class:`GraceWarning` says so when it exceeds
    ``grace_cap_s`` (the platform's limit on preemption: :data:`GKE_SPOT_GRACE_S` on GKE spot).
    Staging (process mode): ``staging_bytes``, or estimated from ``state_bytes`` (the
    workload's resident memory) plus ``gpu_memory_bytes`` (required when the container asks for
    ``nvidia.com/gpu``). State mode: ``state_bytes`` adds the Checkpointer's staging buffer
    (1.125 × the state, ADR 0006) to the memory. ``watch_node_label`` needs a service account
    bound to
    :func:`node_reader_rbac`. In process mode the sidecar uploads what ``cairn run`` spools
    (ADR 0014) and gets the main container's store settings (:func:`store_env`, the volume of a key
    file or of a path store; a :class:`StoreAccessWarning` when a path store is on no volume).
    ``secret_name``: a Kubernetes Secret whose item ``secret_key`` is the encrypted store's
    secret file (``cairn secret new PATH``; ``kubectl create secret generic NAME
    --from-file=cairn.secret=PATH``): mounted read-only into the main container (and the
    uploading sidecar), named by ``CAIRN_SECRET_FILE``; the secret never enters the pod spec
    (ADR 0025).
    ``committed_in_pod`` (a Pod only): the sidecar keeps the committed seqs in the pod's own
    annotation (``--owner-pod``, needs :func:`pod_annotator_rbac`), for a creator that carries
    them to the next pod it makes (the Airflow pod operator; ADR 0049). A Job's pods keep them
    in the Job's annotation without it.
    Raises :class:`ConfigError` naming the fix for bad input.
    """
    mode = coerce_option(PodMode, mode, "mode")
    if secret_name is not None and not (isinstance(secret_name, str) and DNS_NAME.fullmatch(
            secret_name) and isinstance(secret_key, str) and _SECRET_KEY.fullmatch(secret_key)):
        raise ConfigError(f"secret_name={secret_name!r} / secret_key={secret_key!r}: give the "
                          "name of a Kubernetes Secret (lowercase DNS name) and the item that "
                          "holds the secret file")
    staging = coerce_option(Staging, staging, "staging")
    store = check_store(store)
    if not isinstance(sidecar_image, str) or not sidecar_image.strip():
        raise ConfigError("sidecar_image= is empty; build containers/Dockerfile.sidecar and give "
                          "its reference (pinned by tag or digest)")
    if sidecar_image.endswith(":latest") or ":" not in sidecar_image.rsplit("/", 1)[-1] and \
            "@" not in sidecar_image:
        raise ConfigError(f"sidecar_image {sidecar_image!r} is not pinned: give a tag or a digest "
                          "(not latest), so a node never runs a different sidecar than you tested")
    if isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or \
            not 0 < metrics_port < 65536:
        raise ConfigError(f"metrics_port={metrics_port!r} is not a TCP port")
    plan = _PodPlan(
        mode=mode, store=store, container=container, every=every,
        final_s=_seconds(final_snapshot_s, "final_snapshot_s"),
        margin_s=_seconds(grace_margin_s, "grace_margin_s"),
        cap_s=_seconds(grace_cap_s, "grace_cap_s"),
        state_n=_size(state_bytes, "state_bytes"),
        gpu_n=_size(gpu_memory_bytes, "gpu_memory_bytes") or 0,
        staging_n=_size(staging_bytes, "staging_bytes"), staging=staging,
        sidecar_image=sidecar_image.strip(), metrics_port=metrics_port, on_gce=on_gce,
        watch_node_label=watch_node_label, image_pull_policy=image_pull_policy,
        avoid_maintenance=avoid_maintenance, secret_name=secret_name, secret_key=secret_key,
        committed_in_pod=bool(committed_in_pod))

    def transform_pod(manifest: dict[str, Any], pod_key: str,
                      key_env: list[dict[str, Any]]) -> None:
        _transform_pod(plan, manifest, pod_key, key_env)

    manifest, model = _as_manifest(pod)
    kind = manifest.get("kind")
    if kind in (None, "Pod"):
        if key is None:
            raise ConfigError("key= is required for a Pod (a Job's or JobSet's pods get one "
                              "from their namespace, Job and completion index)")
        Key.parse(key)  # raises ConfigError with the key rules
        transform_pod(manifest, key, [])
    elif committed_in_pod:
        raise ConfigError(f"committed_in_pod=True is for a Pod: a {kind}'s pods keep their "
                          "committed seqs in their Job's annotation without it")
    elif kind == "Job":
        check_api_version(manifest, JOB_API_VERSION)
        transform_job(manifest, key=key, what=f"Job {manifest_name(manifest)!r}",
                       transform_pod=transform_pod, several_jobs=False)
    elif kind == "JobSet":
        check_api_version(manifest, JOBSET_API_VERSION)
        transform_jobset(manifest, key=key, replicated_jobs=replicated_jobs,
                          transform_pod=transform_pod)
    else:
        raise ConfigError(f"with_snapshot_sidecar transforms a Pod, a Job ({JOB_API_VERSION}) "
                          f"or a JobSet ({JOBSET_API_VERSION}), not a {kind}: for another "
                          "workload, pass its pod template as {'apiVersion': 'v1', 'kind': "
                          "'Pod', 'metadata': ..., 'spec': template['spec']}")
    return _to_model(manifest, model) if model else manifest


def grant_process_mode(pod: dict[str, Any], *, container: str) -> dict[str, Any]:
    """A copy of the Pod manifest ``pod`` whose ``container`` may run ``cairn run`` itself: ADR
    0008's settings (root, the capabilities CRIU needs, seccomp and AppArmor unconfined), its
    command left as it is. For a container that starts ``cairn run`` from inside (an Airflow
    worker pod running ``CairnRunOperator``), where :func:`with_snapshot_sidecar`'s process mode,
    which wraps the command, does not apply. Raises :class:`ConfigError` naming the fix for
    settings that contradict it (``runAsNonRoot``, a non-root uid, dropped capabilities,
    ``shareProcessNamespace``: CRIU restores exact PIDs, ADR 0007)."""
    manifest = copy.deepcopy(pod)
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        raise ConfigError("the pod has no spec")
    if spec.get("shareProcessNamespace"):
        raise ConfigError("process mode needs the main container in its own PID namespace "
                          "(CRIU restores exact PIDs): remove shareProcessNamespace")
    _process_security(spec, _find_container(spec, container), manifest.setdefault("metadata", {}))
    return manifest
