"""An Indexed Job queued by Kueue, under cairn: each of its pods snapshots its process to the
store and resumes there after a preemption, a drain or a Kueue eviction.

    python examples/kubernetes/kueue_indexed_job.py | kubectl apply -f -

What it prints: a Kueue ``LocalQueue`` (its ClusterQueue ``team-a-cq`` is the cluster admin's),
the Role and RoleBinding the sidecar needs to read its Job (``get`` on ``jobs``: without it a
Kueue eviction is recorded as a preemption), and the Job, transformed by
:func:`cairn.k8s.with_snapshot_sidecar`. Pod ``i`` of the Job keeps its snapshots under the key
``ml/train-llm/i`` (namespace, Job, completion index). When Kueue evicts the workload it sets
``spec.suspend: true``; the pods take a final snapshot in their grace and end ``suspended``;
when Kueue readmits the Job, its new pods resume from those snapshots.
"""

from __future__ import annotations

import sys
from typing import Any

from cairn.k8s import job_reader_rbac, with_snapshot_sidecar

NAMESPACE = "ml"
QUEUE = "team-a"
SERVICE_ACCOUNT = "trainer"
STORE = "gs://my-cairn-bucket/snapshots"  # Workload Identity grants the KSA access
SIDECAR_IMAGE = "registry.example/cairn-sidecar:0.1.0"  # containers/Dockerfile.sidecar, pinned


def local_queue() -> dict[str, Any]:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": NAMESPACE},
            "spec": {"clusterQueue": "team-a-cq"}}


def job() -> dict[str, Any]:
    """The Job as one would write it without cairn."""
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train-llm", "namespace": NAMESPACE,
                     "labels": {"kueue.x-k8s.io/queue-name": QUEUE}},
        "spec": {
            "suspend": True,  # Kueue starts it on admission
            "completionMode": "Indexed", "completions": 4, "parallelism": 4,
            "backoffLimit": 3,
            "podFailurePolicy": {"rules": [  # a preemption is not the step's failure
                {"action": "Ignore", "onExitCodes": {"containerName": "train",
                                                     "operator": "In", "values": [75, 76]}},
                {"action": "Ignore", "onPodConditions": [
                    {"type": "DisruptionTarget", "status": "True"}]}]},
            "template": {"spec": {
                "serviceAccountName": SERVICE_ACCOUNT,
                "restartPolicy": "Never",
                "containers": [{
                    "name": "train", "image": "registry.example/train:1.4",
                    "command": ["python", "train.py", "--shard", "$(JOB_COMPLETION_INDEX)"],
                    "resources": {"requests": {"cpu": "8", "memory": "48Gi"},
                                  "limits": {"memory": "48Gi"}}}]}},
        },
    }


def manifests() -> list[dict[str, Any]]:
    transformed = with_snapshot_sidecar(
        job(), store=STORE, mode="process", sidecar_image=SIDECAR_IMAGE,
        state_bytes="40Gi",  # the workload's resident memory: sizes the staging volume
        every="15m", final_snapshot_s=25.0)
    return [local_queue(), *job_reader_rbac(service_account=SERVICE_ACCOUNT,
                                            namespace=NAMESPACE), transformed]


if __name__ == "__main__":
    import yaml

    yaml.safe_dump_all(manifests(), sys.stdout, sort_keys=False)
