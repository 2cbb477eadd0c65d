"""Jobs and JobSets under cairn: each pod template is transformed as a pod whose key comes from
its namespace, its Job and its completion index (docs/kubernetes.md, "Jobs and JobSets").
``transform_pod`` is the pod transform (:func:`cairn.k8s.transform.with_snapshot_sidecar`'s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime import env
from cairn.store.keys import Key

#: Puts one pod (template) under cairn, in place: ``(pod, pod_key, key_env)``.
TransformPod = Callable[[dict[str, Any], str, list[dict[str, Any]]], None]

JOB_API_VERSION = "batch/v1"
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # on a Job's pods since Kubernetes 1.27
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # Indexed Jobs
NAMESPACE_ENV = env.K8S_NAMESPACE.name
JOB_ENV = env.K8S_JOB.name
INDEX_ENV = env.K8S_COMPLETION_INDEX.name


def manifest_name(manifest: dict[str, Any]) -> str:
    return str((manifest.get("metadata") or {}).get("name") or "(unnamed)")


def check_api_version(manifest: dict[str, Any], wanted: str) -> None:
    given = manifest.get("apiVersion")
    if given not in (None, wanted):
        raise ConfigError(f"a {manifest.get('kind')} of apiVersion {given!r}: cairn transforms "
                          f"{wanted}; convert it to that version first")


def _field_ref(path: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": path}}


def job_key(key: str | None, *, what: str, several_jobs: bool) -> str:
    """The key template of a Job's pods (docs/kubernetes.md, "Jobs and JobSets"): by default
    ``NAMESPACE/JOB/INDEX``; ``key=PREFIX`` gives ``PREFIX/JOB/INDEX``; a ``key`` that names
    ``$(CAIRN_K8S_COMPLETION_INDEX)`` itself is taken as it is (it must tell the pods apart)."""
    index, job, namespace = f"$({INDEX_ENV})", f"$({JOB_ENV})", f"$({NAMESPACE_ENV})"
    if key is None:
        return f"{namespace}/{job}/{index}"
    if not isinstance(key, str):
        raise ConfigError(f"key={key!r} must be text")
    if "$(" not in key:
        Key.parse(key)  # raises ConfigError with the key rules
        return f"{key.strip('/')}/{job}/{index}"
    sample = key.replace(index, "0").replace(job, "train-0").replace(namespace, "ml")
    if "$(" in sample:
        raise ConfigError(f"key {key!r} for {what} names a variable cairn does not set: it may use "
                          f"{namespace}, {job} and {index}")
    if index not in key or (several_jobs and job not in key):
        needed = f"{job} and {index}" if several_jobs else index
        raise ConfigError(f"key {key!r} for {what} does not tell its pods apart: include "
                          f"{needed}, or pass key=None for NAMESPACE/JOB/INDEX")
    Key.parse(sample)
    return key


def transform_job(job: dict[str, Any], *, key: str | None, what: str,
                  transform_pod: TransformPod, several_jobs: bool,
                  default_indexed: bool = False) -> None:
    """Transform the pod template of ``job`` (a Job, or a JobSet's Job template), in place."""
    spec = job.get("spec")
    template = spec.get("template") if isinstance(spec, dict) else None
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        raise ConfigError(f"{what} has no spec.template.spec: give the pod template cairn wraps")
    if default_indexed:  # JobSet's webhook defaults its Jobs to Indexed; say it explicitly
        spec.setdefault("completionMode", "Indexed")
    completion_mode = spec.get("completionMode") or "NonIndexed"
    if completion_mode == "Indexed":
        index_env: dict[str, Any] = {"name": INDEX_ENV, "valueFrom": _field_ref(
            f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']")}
    elif (spec.get("completions") or 1) == 1 and (spec.get("parallelism") or 1) == 1:
        index_env = {"name": INDEX_ENV, "value": "0"}  # one pod at a time: its retries resume
    else:
        raise ConfigError(f"{what} is NonIndexed with completions={spec.get('completions')} and "
                          f"parallelism={spec.get('parallelism')}: its pods have no identity a "
                          "retry could resume as; set spec.completionMode: Indexed (each pod's "
                          "key ends in its completion index), or run one pod (completions and "
                          "parallelism 1)")
    key_env = [{"name": NAMESPACE_ENV, "valueFrom": _field_ref("metadata.namespace")},
               {"name": JOB_ENV, "valueFrom": _field_ref(f"metadata.labels['{JOB_NAME_LABEL}']")},
               index_env]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template.setdefault("metadata", {}),
           "spec": template["spec"]}
    transform_pod(pod, job_key(key, what=what, several_jobs=several_jobs), key_env)


def transform_jobset(jobset: dict[str, Any], *, key: str | None,
                     replicated_jobs: list[str] | tuple[str, ...] | None,
                     transform_pod: TransformPod) -> None:
    """Transform each (or each named) replicated Job's template of ``jobset``, in place."""
    spec = jobset.get("spec")
    jobs = spec.get("replicatedJobs") if isinstance(spec, dict) else None
    if not isinstance(jobs, list) or not jobs:
        raise ConfigError(f"JobSet {manifest_name(jobset)!r} has no spec.replicatedJobs")
    names = [j.get("name") for j in jobs]
    if replicated_jobs is not None:
        if isinstance(replicated_jobs, str) or not replicated_jobs:
            raise ConfigError("replicated_jobs= is a list of replicatedJobs names (None: all)")
        unknown = [n for n in replicated_jobs if n not in names]
        if unknown:
            raise ConfigError(f"replicated_jobs={unknown} are not in JobSet "
                              f"{manifest_name(jobset)!r}, which has {names}")
    several = len(jobs) > 1 or any((j.get("replicas") or 1) > 1 for j in jobs)
    for job in jobs:
        if replicated_jobs is None or job.get("name") in replicated_jobs:
            template = job.get("template")
            what = f"JobSet {manifest_name(jobset)!r} replicatedJob {job.get('name')!r}"
            transform_job({"spec": template.get("spec") if isinstance(template, dict) else None},
                          key=key, what=what, transform_pod=transform_pod,
                          several_jobs=several, default_indexed=True)
