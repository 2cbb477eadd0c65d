"""Checks on a transformed pod that a JSON schema cannot make (shared by the k8s tests)."""

from __future__ import annotations

from typing import Any

from cairn.k8s.quantity import parse_bytes


def semantic_problems(pod: dict[str, Any], *, main: str) -> list[str]:
    """What is wrong with ``pod`` beyond its schema; empty when nothing is."""
    spec = pod["spec"]
    problems: list[str] = []
    init = spec.get("initContainers") or []
    containers = spec.get("containers") or []
    names = [c["name"] for c in init + containers]
    if len(names) != len(set(names)):
        problems.append(f"container names repeat: {names}")
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    if len(volumes) != len(spec.get("volumes") or []):
        problems.append("volume names repeat")
    for c in init + containers:
        for m in c.get("volumeMounts") or []:
            if m["name"] not in volumes:
                problems.append(f"{c['name']} mounts undefined volume {m['name']}")
        paths = [m["mountPath"] for m in c.get("volumeMounts") or []]
        if len(paths) != len(set(paths)):
            problems.append(f"{c['name']} mounts one path twice")
    ports = [p["containerPort"] for c in init + containers for p in c.get("ports") or []]
    if len(ports) != len(set(ports)):
        problems.append(f"container ports collide: {ports}")
    sidecars = [c for c in init if c["name"] == "cairn-sidecar"]
    if len(sidecars) != 1:
        problems.append("no single cairn-sidecar init container")
    elif sidecars[0].get("restartPolicy") != "Always":
        problems.append("the sidecar is not a native sidecar (restartPolicy: Always)")
    if any(c["name"] == "cairn-sidecar" for c in containers):
        problems.append("the sidecar is a regular container")
    # A memory-backed volume mounted by the main container must fit in its memory limit.
    target = next(c for c in containers if c["name"] == main)
    limit = ((target.get("resources") or {}).get("limits") or {}).get("memory")
    request = ((target.get("resources") or {}).get("requests") or {}).get("memory")
    for m in target.get("volumeMounts") or []:
        empty = volumes.get(m["name"], {}).get("emptyDir")
        if empty is not None and empty.get("medium") == "Memory":
            size = parse_bytes(empty.get("sizeLimit", 0))
            if size == 0:
                problems.append(f"memory volume {m['name']} has no sizeLimit")
            for what, value in (("limit", limit), ("request", request)):
                if value is not None and parse_bytes(value) < size:
                    problems.append(f"memory {what} {value} is below volume {m['name']} ({size})")
    if spec.get("shareProcessNamespace"):
        problems.append("shareProcessNamespace is set")
    return problems
