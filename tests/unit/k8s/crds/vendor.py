"""Regenerate the vendored CRD schemas (vendored from jobset 08dfbdfd (v0.13.0-devel) and kueue
ff69552e (v0.20.0-devel), both Aug 2026): ``python tests/unit/k8s/crds/vendor.py JOBSETS.yaml
LOCALQUEUES.yaml`` (from kubernetes-sigs/jobset and kubernetes-sigs/kueue,
``config/components/crd/bases/``). Keeps one served version's ``openAPIV3Schema`` of each,
without descriptions (the bulk of the files; validation never reads them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
WANTED = {"JobSet": "v1alpha2", "LocalQueue": "v1beta2"}


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def main(paths: list[str]) -> None:
    for path in paths:
        crd = yaml.safe_load(Path(path).read_text())
        kind = crd["spec"]["names"]["kind"]
        version = next(v for v in crd["spec"]["versions"] if v["name"] == WANTED[kind])
        doc = {"group": crd["spec"]["group"], "version": version["name"], "kind": kind,
               "schema": _strip(version["schema"]["openAPIV3Schema"])}
        out = HERE / f"{kind.lower()}-{version['name']}.json"
        out.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
        print(out, out.stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1:])
