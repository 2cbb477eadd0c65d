"""examples/kubernetes/kueue_indexed_job.py: what it prints validates (the Job and the RBAC
strict for Kubernetes 1.29 and the newest schema, the LocalQueue against Kueue's vendored CRD
schema), the Job stays queued by Kueue, and each pod's key is its own."""

from __future__ import annotations

import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import kubernetes_validate
import yaml
from kubernetes_validate.utils import latest_version

from tests.unit.k8s import crd_schemas
from tests.unit.k8s.test_transform_jobs import _keys_in_pod, _pod_meta

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kubernetes" / "kueue_indexed_job.py"


def test_the_example_validates_and_keys_each_pod() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no grace or store-access warning in the example
        docs = runpy.run_path(str(EXAMPLE))["manifests"]()
    kinds = [d["kind"] for d in docs]
    assert kinds == ["LocalQueue", "Role", "RoleBinding", "Job"]
    crd_schemas.validate(docs[0])
    for doc in docs[1:]:
        for version in ("1.29", latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)
    job = docs[3]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == docs[0]["metadata"]["name"]
    assert job["spec"]["suspend"] is True
    spec = job["spec"]["template"]["spec"]
    keys = [_keys_in_pod(spec, _pod_meta("train-llm", i), "train") for i in range(4)]
    assert keys == [(f"ml/train-llm/{i}",) * 2 for i in range(4)]
    # The user's own $(JOB_COMPLETION_INDEX) is left for the kubelet, behind cairn run's "--".
    main = spec["containers"][0]["command"]
    assert main[main.index("--") + 1:] == ["python", "train.py", "--shard",
                                           "$(JOB_COMPLETION_INDEX)"]


def test_the_example_prints_yaml_kubectl_can_apply() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert [d["kind"] for d in yaml.safe_load_all(out)] == ["LocalQueue", "Role", "RoleBinding",
                                                            "Job"]


def test_the_localqueue_check_can_fail() -> None:
    import jsonschema
    import pytest

    queue = runpy.run_path(str(EXAMPLE))["local_queue"]()
    queue["spec"] = {"clusterQueu": "team-a-cq"}
    with pytest.raises(jsonschema.ValidationError, match="'clusterQueu' was unexpected"):
        crd_schemas.validate(queue)


def test_the_documented_job_rbac_is_what_job_reader_rbac_returns() -> None:
    from cairn.k8s import job_reader_rbac
    from tests.unit.k8s.test_docs import _manifests

    role, binding = job_reader_rbac(service_account="trainer", namespace="ml")
    shown = {m["kind"]: m for m in _manifests()}
    assert shown["Role"] == role and shown["RoleBinding"] == binding
