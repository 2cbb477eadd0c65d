"""Kubernetes: the pod-spec transform, the ``cairn sidecar`` entrypoint, preemption watchers.

``from cairn.k8s import with_snapshot_sidecar``: this package's names (``__all__``) are public
API, for the integrations too; its modules are not. Importing this package pulls in nothing
heavy (the ``kubernetes`` client is optional and imported only when a ``V1Pod`` is passed): the
Airflow provider imports it, and must stay light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COMMITTED_SEQS_ANNOTATION", "PodMode", "SIDECAR_NAME", "Staging", "coerce_option",
           "grant_process_mode", "job_reader_rbac", "node_reader_rbac", "parse_committed_seqs",
           "pod_annotator_rbac", "render_committed_seqs", "to_v1pod", "with_snapshot_sidecar"]

# Where each public name lives, and its name there (the transform's names by default).
_ORIGIN = {
    "job_reader_rbac": ("cairn.k8s.rbac", "job_reader_rbac"),
    "node_reader_rbac": ("cairn.k8s.rbac", "node_reader_rbac"),
    "pod_annotator_rbac": ("cairn.k8s.rbac", "pod_annotator_rbac"),
    # The annotation that keeps the committed seqs (ADR 0049), for whoever carries it from
    # one pod to the next (the Airflow pod operator).
    "COMMITTED_SEQS_ANNOTATION": ("cairn.k8s.committed", "ANNOTATION"),
    "parse_committed_seqs": ("cairn.k8s.committed", "parse_entries"),
    "render_committed_seqs": ("cairn.k8s.committed", "render"),
}


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        module, attribute = _ORIGIN.get(name, ("cairn.k8s.transform", name))
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'cairn.k8s' has no attribute {name!r}")
