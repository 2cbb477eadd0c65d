"""Validation against CRD schemas vendored in ``crds/`` (``crds/vendor.py`` regenerates them):
a CRD's ``openAPIV3Schema`` checked with ``jsonschema``, strict as the API server's structural
pruning is (an unknown field is an error, not silently dropped)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

CRDS = Path(__file__).resolve().parent / "crds"
FILES = {"JobSet": "jobset-v1alpha2.json", "LocalQueue": "localqueue-v1beta2.json"}


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
def _validator(kind: str) -> tuple[jsonschema.protocols.Validator, str]:
    doc = json.loads((CRDS / FILES[kind]).read_text())
    schema = _strict(doc["schema"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema), f"{doc['group']}/{doc['version']}"


def validate(obj: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``obj`` is a valid object of its CRD."""
    validator, api_version = _validator(obj["kind"])
    if obj.get("apiVersion") != api_version:
        raise jsonschema.ValidationError(f"apiVersion {obj.get('apiVersion')!r} is not "
                                         f"{api_version}")
    validator.validate(obj)
