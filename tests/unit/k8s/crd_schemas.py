"""Validation against the CRDs of other projects, as published, from ``../shared/crds/`` beside
the checkout (the project keeps no copy; ``CAIRN_CRDS_DIR`` points elsewhere): a served
version's ``openAPIV3Schema`` checked with ``jsonschema``, strict as the API server's structural
pruning is (an unknown field is an error, not silently dropped)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[3]
CRDS = Path(os.environ.get("CAIRN_CRDS_DIR") or ROOT.parent / "shared" / "crds")
FILES = {
    "JobSet": "jobset.x-k8s.io_jobsets.yaml",
    "LocalQueue": "kueue.x-k8s.io_localqueues.yaml",
    "ClusterQueue": "kueue.x-k8s.io_clusterqueues.yaml",
    "Workload": "kueue.x-k8s.io_workloads.yaml",
}


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd(kind: str) -> dict[str, Any]:
    path = CRDS / FILES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the CRD schemas live in shared/crds/ beside "
                                "the checkout; set CAIRN_CRDS_DIR to a copy of that folder")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    assert crd["spec"]["names"]["kind"] == kind, path
    return crd


@functools.cache
def _validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    crd = _crd(kind)
    group = crd["spec"]["group"]
    for version in crd["spec"]["versions"]:
        if version.get("served") and f"{group}/{version['name']}" == api_version:
            schema = _strict(version["schema"]["openAPIV3Schema"])
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
            return cls(schema)
    served = [f"{group}/{v['name']}" for v in crd["spec"]["versions"] if v.get("served")]
    raise jsonschema.ValidationError(f"apiVersion {api_version!r} of {kind} is not served by "
                                     f"its CRD (served: {', '.join(served)})")


def validate(obj: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``obj`` is a valid object of a version its
    CRD serves."""
    _validator(obj["kind"], str(obj.get("apiVersion"))).validate(obj)
