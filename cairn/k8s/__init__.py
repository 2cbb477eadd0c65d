"""Kubernetes: the pod-spec transform, the ``cairn sidecar`` entrypoint, preemption watchers.

``from cairn.k8s import with_snapshot_sidecar``. Importing this package pulls in nothing heavy
(the ``kubernetes`` client is optional and imported only when a ``V1Pod`` is passed), since the
its watchers and sidecar are imported by the Airflow provider, which must stay light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PodMode", "Staging", "node_reader_rbac", "with_snapshot_sidecar"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cairn.k8s import transform

        return getattr(transform, name)
    raise AttributeError(f"module 'cairn.k8s' has no attribute {name!r}")
