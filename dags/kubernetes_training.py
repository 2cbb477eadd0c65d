"""Process-mode training in a Kubernetes pod with ``CairnKubernetesPodOperator``, placed per try.

The pod runs ``workloads/train_mlp.py`` under ``cairn run``, from an image built ``FROM`` the
cairn runtime image (``containers/Dockerfile.runtime``) with torch and the script added at
``/workspace/train_mlp.py``, with the cairn sidecar that turns a
node's shutdown or spot reclaim into a final snapshot. Each *new* pod is placed by
``cairn.policy``: GKE spot capacity first; after two recorded preemptions of this task instance
(or when the deadline is at risk) the next try goes to on-demand nodes with a higher priority
class. Airflow cannot move a running task, so the choice is made once per try, when its pod is
built; retries run the image digest the first pod pulled.

Needs: a GKE cluster at 1.29 or later reachable through the ``kubernetes_default`` connection,
and a ``cairn_default`` connection whose store is a bucket the pod can write
(``gs://BUCKET/PREFIX``, with Workload Identity for the pod's service account). Parsing this
file needs neither.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag

from cairn.policy import CapacityOption, PolicySettings
from cairn_airflow.kubernetes import CairnKubernetesPodOperator

TRAIN_IMAGE = "REGISTRY/cairn-train-mlp:0.1.0"  # FROM cairn-runtime, + torch and train_mlp.py
SIDECAR_IMAGE = "REGISTRY/cairn-sidecar:0.1.0"

CAPACITY = (
    # GKE Spot VMs: selected by label, spot taint tolerated; ~15 s notice before reclaim.
    CapacityOption.gke_spot("l4-spot", price_per_hour=0.35,
                            node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"},
                            priority_class="cairn-spot"),
    # The same GPUs on demand: three times the price, practically never reclaimed.
    CapacityOption("l4-on-demand", price_per_hour=1.05,
                   node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4",
                                  "cloud.google.com/gke-provisioning": "standard"},
                   priority_class="cairn-on-demand"),
)


@dag(dag_id="cairn_kubernetes_training", schedule=None, catchup=False,
     tags=["cairn", "example", "kubernetes"])
def cairn_kubernetes_training() -> None:
    CairnKubernetesPodOperator(
        task_id="train",
        name="cairn-train",
        namespace="training",
        image=TRAIN_IMAGE,
        cmds=["python", "/workspace/train_mlp.py"],
        arguments=["--steps", "20000"],
        container_resources={"requests": {"cpu": "4", "memory": "16Gi"},
                             "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}},
        mode="process",
        sidecar_image=SIDECAR_IMAGE,
        state_bytes="6Gi",            # the workload's resident memory: sizes the staging volume
        gpu_memory_bytes="8Gi",       # copied into host RAM by the CUDA driver before a dump
        final_snapshot_s=10.0,        # measured; with a 3 s margin it fits GKE spot's 15 s notice
        grace_cap_s=15.0,
        transform_options={"grace_margin_s": 3.0},
        placement=CAPACITY,
        policy_settings=PolicySettings(max_preemptions=2),
        kubernetes_version="1.29",
        get_logs=True,
        on_finish_action="delete_pod",
        retries=4,
        retry_delay=timedelta(seconds=30),
    )


cairn_kubernetes_training()
