"""The manifests shown in docs/kubernetes.md are valid, and its RBAC is what the code grants."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import yaml

from cairn.k8s import node_reader_rbac

DOC = Path(__file__).resolve().parents[3] / "docs" / "kubernetes.md"


def _manifests() -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    docs = []
    for block in blocks:
        if "    ..." in block:  # an excerpt, not a whole object
            continue
        docs += [d for d in yaml.safe_load_all(block) if isinstance(d, dict) and "kind" in d]
    return docs


def test_whole_manifests_in_the_docs_validate() -> None:
    manifests = _manifests()
    assert {m["kind"] for m in manifests} >= {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for manifest in manifests:
        kubernetes_validate.validate(manifest, "1.29", strict=True)


def test_the_documented_rbac_is_what_node_reader_rbac_returns() -> None:
    role, binding = node_reader_rbac(service_account="trainer", namespace="training")
    shown = {m["kind"]: m for m in _manifests()}
    assert shown["ClusterRole"] == role
    assert shown["ClusterRoleBinding"] == binding


def test_the_documented_transform_call_runs_clean() -> None:
    """The Python example, on a GPU pod: no warning, and a pod that validates."""
    import warnings

    block = re.search(r"```python\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train"},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "train", "image": "registry.example/train:1.4",
               "command": ["python", "train.py"],
               "resources": {"limits": {"memory": "64Gi", "nvidia.com/gpu": "1"}}}]}}
    namespace = {"pod": pod}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(block, namespace)  # noqa: S102 - our own documentation
    assert namespace["pod"] is not pod and "initContainers" in namespace["pod"]["spec"]
    kubernetes_validate.validate(namespace["pod"], "1.29", strict=True)
