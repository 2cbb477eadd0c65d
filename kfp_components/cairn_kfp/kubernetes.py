"""kfp-kubernetes helpers: each ``verb_noun(task, ...) -> task``, so they chain.

::

    t = train(entrypoint="my_pkg.train:main")
    use_bucket_store(t, "gs://my-bucket/cairn")
    use_spot_nodes(t)
    set_deadline(t, hours=12)
    set_retries(t, 5, backoff="60s")

What kfp-kubernetes cannot do (sidecars, capabilities, seccomp, termination grace) is not here:
process mode's privileges come from the cluster-side policy (``deploy/``), keyed on the label
:func:`add_process_mode_label` sets.
"""

from __future__ import annotations

import re

from kfp import kubernetes
from kfp.dsl import PipelineTask

from cairn.exceptions import ConfigError
from cairn.runtime import env as contract

#: The pod label the mutation policy in ``deploy/cairn-process-mode-policy.yaml`` matches.
PROCESS_MODE_LABEL = "cairn.dev/process-mode"
SPOT_LABEL = "cloud.google.com/gke-spot"
_DURATION = re.compile(r"^\d+(\.\d+)?s$")


def use_bucket_store(task: PipelineTask, url: str) -> PipelineTask:
    """Point the task at a bucket store (``CAIRN_STORE``) reached without a key file.

    For ``gs://``, through Workload Identity: the run's Kubernetes service account (KFP:
    ``service_account=`` when the run is created; default ``pipeline-runner``) is bound to a
    Google service account with ``roles/iam.workloadIdentityUser``, and that one holds
    ``roles/storage.objectUser`` on the bucket; the task is pinned to nodes that run the GKE
    metadata server (the store kind's node selector). For a volume use :func:`use_pvc_store`.
    """
    from cairn.store import store_kind, url_forms

    kind = store_kind(url) if isinstance(url, str) and url.strip() else None
    if kind is None or not kind.remote:
        raise ConfigError(f"use_bucket_store needs a bucket URL ({url_forms(remote=True)}), "
                          f"got {url!r}; for a volume use use_pvc_store")
    task.set_env_variable(contract.STORE.name, url.strip())
    for label, value in kind.node_selector:
        kubernetes.add_node_selector(task, label_key=label, label_value=value)
    return task


#: The name of :func:`use_bucket_store` in pipelines written when GCS was the only bucket.
use_gcs_store = use_bucket_store


def use_pvc_store(task: PipelineTask, pvc_name: str, *,
                  mount_path: str = "/mnt/cairn-store") -> PipelineTask:
    """Mount a PersistentVolumeClaim as the store (``CAIRN_STORE`` = ``mount_path``).

    Only where one node is acceptable: a ReadWriteOnce disk follows the pod only to a node in
    its zone, after the old node let go of it. NFS and gcsfuse volumes are refused by the
    store (no create-only publish); across nodes use :func:`use_gcs_store`.
    """
    if not pvc_name:
        raise ConfigError("use_pvc_store needs the name of a PersistentVolumeClaim")
    if not mount_path.startswith("/"):
        raise ConfigError(f"mount_path must be absolute, got {mount_path!r}")
    kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=mount_path)
    task.set_env_variable(contract.STORE.name, mount_path)
    return task


def use_spot_nodes(task: PipelineTask) -> PipelineTask:
    """Run on GKE spot nodes: the node selector ``cloud.google.com/gke-spot: "true"`` and the
    toleration of their taint. Pair it with :func:`set_retries`: a reclaimed node fails the
    attempt, and the retry resumes from the last snapshot."""
    kubernetes.add_node_selector(task, label_key=SPOT_LABEL, label_value="true")
    kubernetes.add_toleration(task, key=SPOT_LABEL, operator="Equal", value="true",
                              effect="NoSchedule")
    return task


def set_deadline(task: PipelineTask, *, seconds: int = 0, hours: float = 0) -> PipelineTask:
    """Bound one attempt's pod (``activeDeadlineSeconds``); a retry gets a fresh deadline."""
    total = int(seconds + hours * 3600)
    if total <= 0:
        raise ConfigError("set_deadline needs seconds= or hours= above zero")
    kubernetes.set_timeout(task, seconds=total)
    return task


def set_retries(task: PipelineTask, num_retries: int, *, backoff: str = "30s",
                factor: float = 2.0, max_backoff: str = "3600s") -> PipelineTask:
    """Retry a failed attempt ``num_retries`` times, waiting ``backoff`` × ``factor``^n (at
    most ``max_backoff``) in between; every retry resumes from the last snapshot."""
    if not isinstance(num_retries, int) or num_retries < 1:
        raise ConfigError("num_retries must be an integer of at least 1")
    for name, value in (("backoff", backoff), ("max_backoff", max_backoff)):
        if not _DURATION.match(value):
            raise ConfigError(f"{name} must be seconds written like '30s', got {value!r}")
    if factor < 1:
        raise ConfigError("factor must be at least 1")
    task.set_retry(num_retries=num_retries, backoff_duration=backoff, backoff_factor=factor,
                   backoff_max_duration=max_backoff)
    return task


def add_process_mode_label(task: PipelineTask) -> PipelineTask:
    """Label the pod for the process-mode mutation policy (capabilities, seccomp Unconfined;
    ``deploy/cairn-process-mode-policy.yaml``). Self-hosted KFP with that policy installed
    only; Vertex AI Pipelines gets state mode only."""
    kubernetes.add_pod_label(task, label_key=PROCESS_MODE_LABEL, label_value="true")
    return task
