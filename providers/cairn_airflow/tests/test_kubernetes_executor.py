"""The KubernetesExecutor pod template: generated, merged by Airflow's own code, validated strict.

Each task's pod is built by the cncf provider's real pod-building path,
``AirflowKubernetesScheduler._build_pod_request`` (no API calls): it reads the template file
with ``PodGenerator.deserialize_model_file``, turns a real ``ExecuteTask`` workload into the
base container's command and merges the task's ``executor_config`` pod_override with
``PodGenerator.construct_pod`` and the ``pod_mutation_hook``. The scheduler object is made
without its constructor, which starts watcher processes that need a Kubernetes API server; that
is the one thing that cannot run here. The final pod is validated strict with
kubernetes-validate against Kubernetes 1.29 (the oldest with native sidecars) and 1.37.
"""

from __future__ import annotations

import json
import shlex
import shutil
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from cairn.exceptions import ConfigError
from cairn.k8s import with_snapshot_sidecar
from cairn_airflow.kubernetes_executor import main, pod_template

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples" / "kubernetes_executor"
BASE = EXAMPLES / "base_pod_template.yaml"
SIDECAR_IMAGE = "REGISTRY/cairn-sidecar:0.1.0"
KUBE_IMAGE = ("registry.example/airflow-cairn", "3.3.2-cairn")
VERSIONS = ("1.29", "1.37")


def _manifest(pod: Any) -> dict[str, Any]:
    return ApiClient().sanitize_for_serialization(pod)


def _write(tmp_path: Path, name: str, template: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(template, sort_keys=False))
    return path


class ExecutorPods:
    """Builds task pods the way the KubernetesExecutor does, for one ``pod_template_file``."""

    def __init__(self, template_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from airflow.providers.cncf.kubernetes.executors.kubernetes_executor_utils import (
            AirflowKubernetesScheduler,
        )
        from airflow.providers.cncf.kubernetes.kube_config import KubeConfig

        section = "AIRFLOW__KUBERNETES_EXECUTOR__"
        monkeypatch.setenv(section + "POD_TEMPLATE_FILE", str(template_file))
        monkeypatch.setenv(section + "NAMESPACE", "airflow")
        monkeypatch.setenv(section + "WORKER_CONTAINER_REPOSITORY", KUBE_IMAGE[0])
        monkeypatch.setenv(section + "WORKER_CONTAINER_TAG", KUBE_IMAGE[1])
        # Made without __init__, which starts the pod watchers (they need an API server).
        scheduler = AirflowKubernetesScheduler.__new__(AirflowKubernetesScheduler)
        scheduler.kube_config = KubeConfig()
        scheduler.namespace = scheduler.kube_config.kube_namespace
        scheduler.scheduler_job_id = "7"
        scheduler.supports_task_instance_uuid = False
        self.scheduler = scheduler

    def pod(self, task: Any, *, run_id: str = "manual__2026-12-02", map_index: int = -1,
            try_number: int = 1) -> tuple[k8s.V1Pod, list[str]]:
        """The pod of ``task``'s try, and the command Airflow gave its base container."""
        from airflow.executors.workloads import ExecuteTask
        from airflow.executors.workloads.base import BundleInfo
        from airflow.executors.workloads.task import TaskInstanceDTO
        from airflow.providers.cncf.kubernetes.executors.kubernetes_executor_types import (
            KubernetesJob,
        )
        from airflow.providers.cncf.kubernetes.pod_generator import (
            PodGenerator,
            workload_to_command_args,
        )

        executor_config = task.executor_config or {}
        ti = TaskInstanceDTO(id=uuid.uuid4(), task_id=task.task_id, dag_id=task.dag_id,
                             run_id=run_id, try_number=try_number, map_index=map_index,
                             dag_version_id=uuid.uuid4(), pool_slots=1, priority_weight=1,
                             executor_config=executor_config)
        workload = ExecuteTask(token="", ti=ti, dag_rel_path=Path("cairn_k8s.py"),
                               bundle_info=BundleInfo(name="dags-folder"), log_path=None)
        # What KubernetesExecutor.execute_async queues for the workload.
        job = KubernetesJob(key=ti.key, command=[workload],
                            kube_executor_config=PodGenerator.from_obj(executor_config),
                            pod_template_file=executor_config.get("pod_template_file"))
        return self.scheduler._build_pod_request(job), workload_to_command_args(workload)


def _dag_tasks(process_template: Path | None = None) -> dict[str, Any]:
    from airflow.sdk import DAG, task

    from cairn_airflow.command import CairnRunOperator

    with DAG("cairn_k8s", schedule=None) as dag:
        @task.cairn(every_steps=10, executor_config={"pod_override": k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(labels={"team": "ml"}),
            spec=k8s.V1PodSpec(
                containers=[k8s.V1Container(name="base", env=[
                    k8s.V1EnvVar(name="TRAIN_SHARDS", value="8")])],
                node_selector={"cloud.google.com/gke-spot": "true"},
                tolerations=[k8s.V1Toleration(key="cloud.google.com/gke-spot",
                                              operator="Equal", value="true",
                                              effect="NoSchedule")]))})
        def train(ckpt: Any) -> None:
            pass

        train()
        if process_template is not None:
            CairnRunOperator(task_id="simulate", command=["python", "simulate.py"],
                             executor_config={"pod_template_file": str(process_template)})
    return {t.task_id: t for t in dag.tasks}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def _check_structure(doc: dict[str, Any]) -> None:
    """What the API server would also reject and a JSON schema cannot say."""
    spec = doc["spec"]
    names = [c["name"] for c in spec.get("initContainers", []) + spec["containers"]]
    assert len(names) == len(set(names)), names
    volumes = [v["name"] for v in spec["volumes"]]
    assert len(volumes) == len(set(volumes)), volumes
    for c in spec.get("initContainers", []) + spec["containers"]:
        env_names = [e["name"] for e in c.get("env") or []]
        assert len(env_names) == len(set(env_names)), (c["name"], env_names)
        assert {m["name"] for m in c.get("volumeMounts") or []} <= set(volumes)


def _validate(doc: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)
    _check_structure(doc)


# -- the state-mode template under the executor's merge ------------------------------------------

def test_a_task_pod_keeps_the_sidecar_airflows_command_and_the_tasks_override(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    template = pod_template(BASE, sidecar_image=SIDECAR_IMAGE, final_snapshot_s=8,
                            grace_cap_s=30, state_bytes="1Gi")
    pods = ExecutorPods(_write(tmp_path, "pod_template.yaml", template), monkeypatch)
    pod, command = pods.pod(_dag_tasks()["train"])
    doc = _manifest(pod)
    _validate(doc)
    spec = doc["spec"]

    sidecar = spec["initContainers"][0]
    assert sidecar["name"] == "cairn-sidecar" and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == SIDECAR_IMAGE and "--upload" not in sidecar["args"]
    assert [c["name"] for c in spec["containers"]] == ["base"]
    base = spec["containers"][0]
    assert base["args"] == command and "command" not in base  # Airflow's, not cairn's
    assert command[:3] == ["python", "-m", "airflow.sdk.execution_time.execute_workload"]
    assert base["image"] == ":".join(KUBE_IMAGE)
    env = _env(base)
    assert env["CAIRN_NOTICE_FILE"] == "/var/run/cairn/notice.json"
    assert env["CAIRN_STATUS_FILE"] == "/var/run/cairn/status.json"
    assert env["AIRFLOW_IS_K8S_EXECUTOR_POD"] == "True" and env["TRAIN_SHARDS"] == "8"
    assert "CAIRN_KEY" not in env and "CAIRN_STORE" not in env  # set per task at run time
    assert {"name": "cairn-shared", "mountPath": "/var/run/cairn"} in base["volumeMounts"]
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} == {"/var/run/cairn"}
    shared = next(v for v in spec["volumes"] if v["name"] == "cairn-shared")
    assert shared["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Mi"}
    # 4Gi from the base template + the 16Mi volume + 1.125 x 1Gi of Checkpointer staging.
    assert base["resources"]["limits"]["memory"] == "5264Mi"
    assert spec["terminationGracePeriodSeconds"] == 30
    # The task's pod_override merged in: labels, node selector, tolerations.
    assert doc["metadata"]["labels"]["team"] == "ml"
    assert doc["metadata"]["labels"]["app"] == "airflow-worker"
    assert doc["metadata"]["annotations"]["task_id"] == "train"
    assert spec["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert spec["tolerations"][0]["key"] == "cloud.google.com/gke-spot"


def test_two_task_instances_get_pods_that_differ_only_in_airflows_fields(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing per task comes from the template: no key two tasks could share."""
    template = pod_template(BASE, sidecar_image=SIDECAR_IMAGE)
    pods = ExecutorPods(_write(tmp_path, "pod_template.yaml", template), monkeypatch)
    train = _dag_tasks()["train"]
    first, command_1 = pods.pod(train, map_index=0)
    second, command_2 = pods.pod(train, map_index=1, try_number=2)
    a, b = _manifest(first), _manifest(second)
    assert command_1 != command_2
    for doc in (a, b):
        _validate(doc)
        doc["metadata"].pop("name")
        for field in ("labels", "annotations"):
            for name in ("map_index", "try_number"):
                doc["metadata"][field].pop(name)
        doc["spec"]["containers"][0].pop("args")
    assert a == b
    assert "cairn-pod-template" not in json.dumps(a)  # the transform's stand-ins are gone


def test_a_pod_override_with_resources_replaces_the_templates_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow merges a container's ``resources`` whole, not field by field: a task that sets
    its own must count the cairn volume and staging itself (docs/distributed-airflow.md)."""
    from airflow.sdk import DAG, task

    template = pod_template(BASE, sidecar_image=SIDECAR_IMAGE)
    pods = ExecutorPods(_write(tmp_path, "pod_template.yaml", template), monkeypatch)
    resources = k8s.V1ResourceRequirements(requests={"cpu": "2", "memory": "8Gi"},
                                           limits={"memory": "8Gi"})
    with DAG("cairn_k8s_big", schedule=None):
        @task.cairn(executor_config={"pod_override": k8s.V1Pod(spec=k8s.V1PodSpec(
            containers=[k8s.V1Container(name="base", resources=resources)]))})
        def big(ckpt: Any) -> None:
            pass

        big_task = big().operator
    doc = _manifest(pods.pod(big_task)[0])
    _validate(doc)
    base = doc["spec"]["containers"][0]
    assert base["resources"]["limits"] == {"memory": "8Gi"}
    assert {"name": "cairn-shared", "mountPath": "/var/run/cairn"} in base["volumeMounts"]


# -- process mode: a second template, chosen per task ---------------------------------------------

def test_a_cairn_run_task_gets_the_privileged_template_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _write(tmp_path, "pod_template.yaml",
                   pod_template(BASE, sidecar_image=SIDECAR_IMAGE))
    process = _write(tmp_path, "pod_template_process.yaml",
                     pod_template(BASE, sidecar_image=SIDECAR_IMAGE, mode="process",
                                  final_snapshot_s=8))
    pods = ExecutorPods(state, monkeypatch)
    tasks = _dag_tasks(process_template=process)
    run_doc = _manifest(pods.pod(tasks["simulate"])[0])
    train_doc = _manifest(pods.pod(tasks["train"])[0])
    for doc in (run_doc, train_doc):
        _validate(doc)

    base = run_doc["spec"]["containers"][0]
    sc = base["securityContext"]
    assert sc["runAsUser"] == 0 and sc["seccompProfile"] == {"type": "Unconfined"}
    assert set(sc["capabilities"]["add"]) >= {"SYS_ADMIN", "SYS_PTRACE", "SYS_TIME",
                                              "NET_ADMIN"}
    assert run_doc["metadata"]["annotations"][
        "container.apparmor.security.beta.kubernetes.io/base"] == "unconfined"
    assert not run_doc["spec"].get("shareProcessNamespace")  # CRIU restores exact PIDs
    assert "command" not in base  # CairnRunOperator starts `cairn run` itself
    env = _env(base)
    assert "CAIRN_SPOOL_DIR" not in env and "CAIRN_KEY" not in env  # it uploads itself
    assert env["CAIRN_NOTICE_FILE"] == "/var/run/cairn/notice.json"
    sidecar = run_doc["spec"]["initContainers"][0]
    assert sidecar["name"] == "cairn-sidecar" and "--upload" not in sidecar["args"]
    assert run_doc["spec"]["terminationGracePeriodSeconds"] == 30  # 8 s + 10 s margin < 30
    # Every other task keeps the unprivileged default template.
    assert "securityContext" not in train_doc["spec"]["containers"][0]
    assert "container.apparmor.security.beta.kubernetes.io/base" not in (
        train_doc["metadata"].get("annotations") or {})


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "options", "fix"), [
    (lambda m: m["spec"]["containers"][0].update(name="worker"), {},
     "name it so and put it first"),
    (lambda m: m["spec"]["containers"].insert(0, {"name": "proxy", "image": "p:1"}), {},
     "name it so and put it first"),
    (lambda m: m.update(kind="Job", apiVersion="batch/v1"), {}, "a pod_template_file is a v1 Pod"),
    (lambda m: m["spec"].pop("containers"), {}, "give it a first container named 'base'"),
    (None, {"key": "a/b/c"}, "the cairn operator in the pod sets CAIRN_KEY at run time"),
    (None, {"store": "gs://b/p"}, "store_url= or the cairn connection"),
    (None, {"every": "5m"}, "every_steps=/every_seconds="),
    (None, {"retries": 3}, "unknown option retries="),
    (None, {"sidecar_image": "REGISTRY/cairn-sidecar:latest"}, "is not pinned"),
    (None, {"mode": "process", "state_bytes": "1Gi"}, "size the base container's memory"),
    (lambda m: m["spec"]["containers"][0].update(securityContext={"runAsNonRoot": True}),
     {"mode": "process"}, "remove runAsNonRoot, or use mode='state'"),
    (lambda m: m["spec"].update(shareProcessNamespace=True), {"mode": "process"},
     "remove shareProcessNamespace"),
    (lambda m: m["spec"]["containers"][0].update(stdin_once=True), {},
     "strict validation also rejects unknown fields"),
    (None, {"kubernetes_version": "1.28"}, "needs Kubernetes 1.29 or later"),
])
def test_bad_input_is_refused_naming_the_fix(change: Any, options: dict[str, Any],
                                             fix: str) -> None:
    base = yaml.safe_load(BASE.read_text())
    if change is not None:
        change(base)
    options = {"sidecar_image": SIDECAR_IMAGE, **options}
    with pytest.raises(ConfigError, match=None) as raised:
        pod_template(base, **options)
    assert fix in str(raised.value), str(raised.value)


def test_the_base_template_is_not_changed_and_a_template_is_not_transformed_twice() -> None:
    base = yaml.safe_load(BASE.read_text())
    before = json.dumps(base)
    once = pod_template(base, sidecar_image=SIDECAR_IMAGE)
    assert json.dumps(base) == before
    with pytest.raises(ConfigError, match="transformed already"):
        pod_template(once, sidecar_image=SIDECAR_IMAGE)
    # The same base through the transform for one pod gives the same pod, key and store aside.
    single = with_snapshot_sidecar(base, store="gs://b/p", key="d/t/r/-1", mode="state",
                                   sidecar_image=SIDECAR_IMAGE, container="base")
    single["spec"]["containers"][0]["env"] = [
        e for e in single["spec"]["containers"][0]["env"]
        if e["name"] not in ("CAIRN_KEY", "CAIRN_STORE")]
    assert single == once


def test_the_cli_says_what_is_wrong_with_exit_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing.yaml"), "--sidecar-image", SIDECAR_IMAGE]) == 2
    assert "give the path of your worker pod template" in capsys.readouterr().err
    assert main([str(BASE), "--sidecar-image", "cairn-sidecar"]) == 2
    assert "not pinned" in capsys.readouterr().err


# -- the examples are what the code writes --------------------------------------------------------

@pytest.mark.parametrize("name", ["pod_template.yaml", "pod_template_process.yaml"])
def test_the_example_templates_are_up_to_date(name: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Rerunning the command in the example's header, from a copy of the repository's layout,
    writes the same bytes."""
    shipped = EXAMPLES / name
    text = shipped.read_text()
    command = shlex.split(text.splitlines()[1].removeprefix("# "))
    assert command[:3] == ["python", "-m", "cairn_airflow.kubernetes_executor"]
    (tmp_path / "examples" / "kubernetes_executor").mkdir(parents=True)
    shutil.copy(BASE, tmp_path / "examples" / "kubernetes_executor" / BASE.name)
    monkeypatch.chdir(tmp_path)
    assert main(command[3:]) == 0
    out = Path(command[command.index("--output") + 1])
    assert out.resolve().parent == (tmp_path / "examples" / "kubernetes_executor").resolve()
    assert out.read_bytes() == shipped.read_bytes(), f"regenerate {shipped}: {' '.join(command)}"
    _validate(yaml.safe_load(text))


def test_the_documented_airflow_cfg_is_the_examples() -> None:
    import configparser

    doc = (REPO / "docs" / "kubernetes.md").read_text()
    cfg = configparser.ConfigParser()
    cfg.read(EXAMPLES / "airflow.cfg")
    line = f"pod_template_file = {cfg['kubernetes_executor']['pod_template_file']}"
    assert f"[kubernetes_executor]\n{line}\n" in doc
    assert cfg["core"]["executor"] == "KubernetesExecutor"
    assert Path(cfg["kubernetes_executor"]["pod_template_file"]).name == "pod_template.yaml"
