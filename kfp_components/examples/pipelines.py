"""Example pipelines (compiled into ``examples/compiled/`` and compared in the tests).

- ``training_pipeline``: state mode, for Vertex AI Pipelines and self-hosted KFP alike: a
  ``train`` step on spot nodes with a GCS store through Workload Identity, retried with
  backoff, then ``batch_inference`` over each dataset with ParallelFor (one key per dataset).
- ``process_mode_pipeline``: self-hosted KFP only: an unmodified script under ``cairn run``,
  its pod labelled for the cluster's process-mode policy (``deploy/``).
- ``s3_store_pipeline``: state mode on EKS (or any cluster with an S3-compatible store): a
  ``train`` step whose snapshots go to S3, credentials from the run's service account through
  IRSA or EKS Pod Identity (no key in the pipeline), on Karpenter's spot nodes.
- ``spot_fallback_pipeline``: ``train`` on A100 spot nodes with three resuming retries, then
  an on-demand A100 fallback task on the same key that resumes from the spot task's last
  snapshot (``cairn_kfp.with_fallback``); the fallback's output is the step's result either way.

Compile: ``python kfp_components/examples/pipelines.py OUT_DIR``. The functions named by
``entrypoint=``/``predictor=`` (``my_project.train:main``, ``my_project.infer:predict``) stand
for your own code, installed in the image you pass as ``image``.
"""

# No `from __future__ import annotations`: kfp reads a pipeline's annotations as objects.

import sys
from pathlib import Path

from kfp import compiler, dsl, kubernetes

import cairn_kfp
from cairn.policy import CapacityOption
from cairn_kfp.kubernetes import (
    add_process_mode_label,
    set_deadline,
    set_retries,
    use_bucket_store,
    use_gcs_store,
    use_spot_nodes,
)

STORE = "gs://my-bucket/cairn"


@dsl.pipeline(name="cairn-training", description="Training and inference that resume on retry.")
def training_pipeline(dataset_uris: list = [  # noqa: B006 - KFP default
        "gs://my-bucket/data/eval", "gs://my-bucket/data/test"]) -> dict:
    trained = cairn_kfp.train(
        entrypoint="my_project.train:main",
        # A literal dict: KFP would pass a pipeline parameter inside it as placeholder text.
        arguments={"epochs": 3, "lr": 0.001},
        cairn_options={"every_seconds": 300.0},
    )
    use_gcs_store(trained, STORE)
    use_spot_nodes(trained)
    set_deadline(trained, hours=12)
    set_retries(trained, 5, backoff="60s")
    trained.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)

    with dsl.ParallelFor(dataset_uris) as uri:  # cairn_loop_item: the URI, one key each
        data = dsl.importer(artifact_uri=uri, artifact_class=dsl.Dataset, reimport=False)
        scored = cairn_kfp.batch_inference(predictor="my_project.infer:predict",
                                           inputs=data.output)
        scored.after(trained)
        use_gcs_store(scored, STORE)
        use_spot_nodes(scored)
        set_retries(scored, 5, backoff="60s")
    return trained.output


finetune = cairn_kfp.run_command(
    ["python", "-m", "my_project.finetune", "--epochs", "3"], name="finetune", every="10m",
    grace="30s")


@dsl.pipeline(name="cairn-process-mode", description="An unmodified script under cairn run.")
def process_mode_pipeline(store: str = STORE) -> None:
    task = cairn_kfp.call(finetune, cairn_store=store)
    add_process_mode_label(task)
    use_spot_nodes(task)
    set_retries(task, 3, backoff="60s")


S3_STORE = "s3://my-bucket/cairn"


@dsl.pipeline(name="cairn-s3-store", description="Training on EKS spot nodes, snapshots in S3.")
def s3_store_pipeline() -> dict:
    trained = cairn_kfp.train(
        entrypoint="my_project.train:main", arguments={"epochs": 3, "lr": 0.001},
        cairn_options={"every_seconds": 300.0})
    # IRSA / EKS Pod Identity: create the run with a service account bound to an IAM role
    # allowed s3:GetObject, PutObject, DeleteObject and ListBucket on the bucket.
    use_bucket_store(trained, S3_STORE)
    trained.set_env_variable("AWS_REGION", "us-east-1")
    kubernetes.add_node_selector(trained, label_key="karpenter.sh/capacity-type",
                                 label_value="spot")
    set_retries(trained, 5, backoff="60s")
    trained.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
    return trained.output


A100 = {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"}
A100_SPOT = CapacityOption.gke_spot("a100-spot", price_per_hour=1.15, node_selector=A100)
A100_ON_DEMAND = CapacityOption("a100", price_per_hour=3.67, node_selector=A100)


@dsl.pipeline(name="cairn-spot-fallback",
              description="Spot first; an on-demand fallback resumes from the spot snapshots.")
def spot_fallback_pipeline() -> dict:
    spot, fallback = cairn_kfp.with_fallback(
        cairn_kfp.train, spot=A100_SPOT, on_demand=A100_ON_DEMAND, spot_retries=3,
        backoff="60s", avoid_maintenance=True,
        entrypoint="my_project.train:main", arguments={"epochs": 3, "lr": 0.001},
        cairn_options={"every_seconds": 300.0})
    for task in (spot, fallback):
        use_gcs_store(task, STORE)
        set_deadline(task, hours=12)
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
    return fallback.output  # the step's result, whichever task finished the work


PIPELINES = {"training_pipeline": training_pipeline,
             "process_mode_pipeline": process_mode_pipeline,
             "s3_store_pipeline": s3_store_pipeline,
             "spot_fallback_pipeline": spot_fallback_pipeline}


def compile_all(out_dir: Path) -> list[Path]:
    """Compile every example pipeline to ``out_dir/<name>.yaml``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, pipeline in PIPELINES.items():
        path = out_dir / f"{name}.yaml"
        compiler.Compiler().compile(pipeline, str(path))
        written.append(path)
    return written


if __name__ == "__main__":
    for path in compile_all(Path(sys.argv[1] if len(sys.argv) > 1 else "compiled")):
        print(path)
