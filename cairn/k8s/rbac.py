"""The Kubernetes grants the sidecar's optional watchers and the annotations that keep the
committed seqs (its owner Job's, or a bare pod's own) need, as manifests to apply."""

from __future__ import annotations

import re
from typing import Any

from cairn.exceptions import ConfigError

#: A Kubernetes object name (RFC 1123 subdomain).
DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def node_reader_rbac(*, service_account: str, namespace: str,
                     name: str = "cairn-node-reader") -> list[dict[str, Any]]:
    """The ClusterRole and ClusterRoleBinding ``watch_node_label=True`` needs: ``get`` on
    ``nodes`` (the sidecar reads its own Node's labels; nodes are cluster-scoped)."""
    for what, value in (("service_account", service_account), ("namespace", namespace),
                        ("name", name)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{what}= is empty")
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": f"{name}-{namespace}-{service_account}"[:253]},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": service_account,
                             "namespace": namespace}]}
    return [role, binding]


def job_reader_rbac(*, service_account: str, namespace: str,
                    name: str = "cairn-job-reader") -> list[dict[str, Any]]:
    """The Role and RoleBinding a Job pod's sidecar (``--owner-job``) needs, on ``jobs`` in the
    Job's namespace: ``get`` to tell a Kueue eviction from a drain (its own Job's
    ``spec.suspend``; without it a suspended Job's try ends ``preempted``) and to read the
    committed seqs the Job's annotation keeps, ``patch`` to keep them there
    (:mod:`cairn.k8s.committed`; without it only a pod's own file refuses a rollback, and the
    Job's next pod cannot)."""
    return _role(service_account=service_account, namespace=namespace, name=name,
                 rule={"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "patch"]})


def _role(*, service_account: str, namespace: str, name: str,
          rule: dict[str, Any]) -> list[dict[str, Any]]:
    """A Role of one ``rule`` in ``namespace`` and its RoleBinding to the service account."""
    for what, value in (("service_account", service_account), ("namespace", namespace),
                        ("name", name)):
        if not isinstance(value, str) or not DNS_NAME.fullmatch(value):
            raise ConfigError(f"{what}={value!r} is not a Kubernetes name")
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name, "namespace": namespace}, "rules": [rule]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": f"{name}-{service_account}"[:253], "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                           "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": service_account,
                             "namespace": namespace}]}
    return [role, binding]


def pod_annotator_rbac(*, service_account: str, namespace: str,
                       name: str = "cairn-pod-annotator") -> list[dict[str, Any]]:
    """The Role and RoleBinding a bare pod's sidecar (``--owner-pod``: the Airflow pod
    operator's pods) needs, on ``pods`` in the pod's namespace: ``get`` and ``patch`` to keep
    the committed seqs in its own pod's annotation (:mod:`cairn.k8s.committed`; without them
    only the pod's own file refuses a rollback, and the operator's next pod cannot). A Role
    cannot name a pod it has not seen, so the grant covers the namespace's pods: give the
    step's pods a service account of their own."""
    return _role(service_account=service_account, namespace=namespace, name=name,
                 rule={"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]})
