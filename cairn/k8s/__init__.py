"""Kubernetes: the pod-spec transform, the ``cairn sidecar`` entrypoint, preemption watchers.

``from cairn.k8s import with_snapshot_sidecar``: this package's names (``__all__``) are public
API, for the integrations too; its modules are not. Importing this package pulls in nothing
heavy (the ``kubernetes`` client is optional and imported only when a ``V1Pod`` is passed): the
Airflow provider imports it, and must stay light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PodMode", "Staging", "coerce_option", "grant_process_mode", "job_reader_rbac",
           "node_reader_rbac", "to_v1pod", "with_snapshot_sidecar"]


_RBAC = frozenset({"job_reader_rbac", "node_reader_rbac"})


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        module = importlib.import_module("cairn.k8s.rbac" if name in _RBAC else
                                         "cairn.k8s.transform")
        return getattr(module, name)
    raise AttributeError(f"module 'cairn.k8s' has no attribute {name!r}")
