"""``CairnKubernetesPodOperator``: the pod each try would submit, rendered without a cluster.

The operator's real pod-building path (``build_pod_request_obj``) runs here with a task
instance context: Airflow's KubernetesPodOperator code, Airflow's policy plugin manager with an
administrator's ``pod_mutation_hook`` installed the way ``airflow_local_settings`` installs one,
cairn's transform and policy, a real local store with outcome records, and strict schema
validation. What cannot run here is the Kubernetes API server: the kube config names an address
nothing listens on and no test contacts it; the task state store (served by Airflow's supervisor
at run time) is ``FakeTaskStateStore``, a dict.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from cairn.exceptions import ConfigError, Fenced, Preempted, RestoreFailed, RollbackRefused
from cairn.policy import CapacityOption, PolicySettings
from cairn.store import Key
from cairn import open_store
from cairn.store.outcomes import Outcome, OutcomeKind
from cairn_airflow.kubernetes import IMAGE_STATE_KEY, CairnKubernetesPodOperator
from cairn_airflow.pod_status import (
    digest_of,
    image_digest_from_pod,
    image_repository,
    outcome_from_pod,
    pin_image,
    pod_end_error,
    record_pod_outcome,
)
from cairn_airflow.task_keys import task_key

DIGEST = "sha256:" + "ab" * 32
SPOT = CapacityOption.gke_spot("l4-spot", price_per_hour=0.35, priority_class="cairn-spot")
ON_DEMAND = CapacityOption("l4-on-demand", price_per_hour=1.05,
                           node_selector={"cloud.google.com/gke-provisioning": "standard"},
                           priority_class="cairn-on-demand")


class FakeTaskStateStore:
    """Stands in for Airflow's task state store (a supervisor service at run time): get/set."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def set(self, key: str, value: Any, *, retention: Any = None) -> None:
        self.values[key] = value


def make_operator(kubeconfig: str, store_url: str, **kwargs: Any) -> CairnKubernetesPodOperator:
    from airflow.sdk import DAG

    with DAG(dag_id="k8s_dag", schedule=None):
        options: dict[str, Any] = dict(
            task_id="train", name="train", namespace="training", image="repo/train:1.0",
            cmds=["python", "train.py"], arguments=["--steps", "100"],
            sidecar_image="repo/cairn-sidecar:0.1.0", state_bytes="1Gi", store_url=store_url,
            config_file=kubeconfig, in_cluster=False)
        options.update(kwargs)
        return CairnKubernetesPodOperator(**options)


def context_for(op: CairnKubernetesPodOperator, *, try_number: int = 1,
                state: FakeTaskStateStore | None = None) -> dict[str, Any]:
    """The parts of a task's template context the pod-building path reads, around a real
    RuntimeTaskInstance."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    run_id = "manual__2026-11-29T00:00:00+00:00"
    ti = RuntimeTaskInstance.model_construct(
        id=uuid.uuid4(), task_id=op.task_id, dag_id=op.dag_id, run_id=run_id,
        try_number=try_number, map_index=-1, dag_version_id=uuid.uuid4(), task=op)
    return {"ti": ti, "task_instance": ti, "run_id": run_id, "dag": op.dag,
            "task_state_store": state if state is not None else FakeTaskStateStore()}


def manifest(pod: Any) -> dict[str, Any]:
    return ApiClient().sanitize_for_serialization(pod)


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec = doc["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"]
                if c["name"] == name)


@contextmanager
def local_settings_hook(hook: Callable[[Any], None]) -> Iterator[None]:
    """Install ``hook`` as an administrator's pod_mutation_hook, the way Airflow installs the
    one in airflow_local_settings (``make_plugin_from_local_settings``)."""
    from airflow.policies import make_plugin_from_local_settings
    from airflow.settings import get_policy_plugin_manager

    module = types.ModuleType("airflow_local_settings")
    module.pod_mutation_hook = hook  # type: ignore[attr-defined]
    manager = get_policy_plugin_manager()
    before = set(manager.get_plugins())
    make_plugin_from_local_settings(manager, module, {"pod_mutation_hook"})
    try:
        yield
    finally:
        for plugin in set(manager.get_plugins()) - before:
            manager.unregister(plugin)


@pytest.fixture()
def admin_hook() -> Iterator[list[dict[str, Any]]]:
    """An administrator's hook that notes whether the cairn sidecar is already in the pod and
    adds a label and a toleration of its own."""
    seen: list[dict[str, Any]] = []

    def pod_mutation_hook(pod: Any) -> None:
        names = [c.name for c in pod.spec.init_containers or []]
        seen.append({"init_containers": names, "command": list(pod.spec.containers[0].command)})
        pod.metadata.labels["team"] = "ml-platform"
        pod.spec.tolerations = [*(pod.spec.tolerations or []),
                                k8s.V1Toleration(key="dedicated", operator="Exists")]

    with local_settings_hook(pod_mutation_hook):
        yield seen


def test_the_pod_runs_cairn_with_its_sidecar_and_is_valid_for_1_29(kubeconfig: str,
                                                                   store_url: str) -> None:
    op = make_operator(kubeconfig, store_url)
    context = context_for(op)
    doc = manifest(op.build_pod_request_obj(context))

    base = container(doc, "base")
    key = str(task_key(context))
    assert base["command"][:6] == ["cairn", "run", "--store", store_url, "--key", key]
    assert base["command"][base["command"].index("--"):] == ["--", "python", "train.py",
                                                             "--steps", "100"]
    assert "args" not in base
    sidecar = container(doc, "cairn-sidecar")
    assert sidecar["restartPolicy"] == "Always" and sidecar["image"] == "repo/cairn-sidecar:0.1.0"
    assert {"name": "cairn-shared", "mountPath": "/var/run/cairn"} in base["volumeMounts"]
    assert "SYS_ADMIN" in base["securityContext"]["capabilities"]["add"]
    # Airflow's own labels are there: the transform ran on the operator's finished pod.
    assert doc["metadata"]["labels"]["kubernetes_pod_operator"] == "True"
    assert doc["metadata"]["labels"]["try_number"] == "1"
    kubernetes_validate.validate(doc, "1.29", strict=True)


def test_state_mode_gets_the_checkpointer_env(kubeconfig: str, store_url: str) -> None:
    op = make_operator(kubeconfig, store_url, mode="state")
    context = context_for(op)
    base = container(manifest(op.build_pod_request_obj(context)), "base")
    env = {e["name"]: e.get("value") for e in base["env"]}
    assert base["command"] == ["python", "train.py"]
    assert env["CAIRN_STORE"] == store_url and env["CAIRN_KEY"] == str(task_key(context))


def test_the_transform_runs_before_the_administrators_hook(kubeconfig: str, store_url: str,
                                                           admin_hook: list) -> None:
    op = make_operator(kubeconfig, store_url)
    doc = manifest(op.build_pod_request_obj(context_for(op)))

    assert len(admin_hook) == 1
    assert admin_hook[0]["init_containers"][0] == "cairn-sidecar"  # the hook saw cairn's pod
    assert admin_hook[0]["command"][:2] == ["cairn", "run"]
    assert doc["metadata"]["labels"]["team"] == "ml-platform"       # and its change survived
    assert {"key": "dedicated", "operator": "Exists"} in doc["spec"]["tolerations"]
    assert container(doc, "cairn-sidecar")


def test_a_hook_that_breaks_the_pod_fails_strict_validation(kubeconfig: str,
                                                            store_url: str) -> None:
    def pod_mutation_hook(pod: Any) -> None:
        pod.spec.termination_grace_period_seconds = "soon"

    with local_settings_hook(pod_mutation_hook):
        op = make_operator(kubeconfig, store_url)
        with pytest.raises(ConfigError, match=r"terminationGracePeriodSeconds.*pod_mutation_hook"):
            op.build_pod_request_obj(context_for(op))


def record_preemptions(store_url: str, key: Any, count: int) -> None:
    now = time.time()
    with open_store(store_url) as store:
        for epoch in range(1, count + 1):
            start = now - (count - epoch + 1) * 1800
            store.records.record_outcome(key, Outcome(epoch=epoch, outcome=OutcomeKind.PREEMPTED,
                                              started_at=start, ended_at=start + 1200,
                                              option=SPOT.name, snapshot_cost_s=8.0))


def placed(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]
    env = {e["name"]: e.get("value") for e in container(doc, "base").get("env", [])}
    return {"selector": spec.get("nodeSelector", {}), "tolerations": spec.get("tolerations", []),
            "priority": spec.get("priorityClassName"), "option": env.get("CAIRN_PLACEMENT_OPTION"),
            "every": (container(doc, "base")["command"] + [None] * 8)[7]}  # process mode


def test_with_no_history_a_try_goes_to_spot(kubeconfig: str, store_url: str) -> None:
    op = make_operator(kubeconfig, store_url, placement=[SPOT, ON_DEMAND],
                       policy_settings=PolicySettings(max_preemptions=2))
    got = placed(manifest(op.build_pod_request_obj(context_for(op))))

    assert got["option"] == "l4-spot" and got["priority"] == "cairn-spot"
    assert got["selector"] == {"cloud.google.com/gke-spot": "true"}
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in got["tolerations"]
    assert got["every"] == op.cairn_plan.placement.every


def test_a_retry_that_finds_no_try_in_the_store_is_warned_about(
        kubeconfig: str, store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The pod's try is planned with Airflow's try number: a second try that finds the store
    empty (a volume not mounted on this worker) says so instead of starting from step 0 in
    silence (issue 34)."""
    op = make_operator(kubeconfig, store_url)
    with caplog.at_level(logging.WARNING, logger="cairn.tries"):
        op.build_pod_request_obj(context_for(op, try_number=1))
        assert "holds no try of it" not in caplog.text
        op.build_pod_request_obj(context_for(op, try_number=2))
    assert "this is try 2 of" in caplog.text and "holds no try of it" in caplog.text


def test_the_third_try_after_two_preemptions_goes_on_demand(kubeconfig: str,
                                                            store_url: str) -> None:
    op = make_operator(kubeconfig, store_url, placement=[SPOT, ON_DEMAND],
                       policy_settings=PolicySettings(max_preemptions=2))
    context = context_for(op, try_number=3)
    record_preemptions(store_url, task_key(context), 2)
    doc = manifest(op.build_pod_request_obj(context))
    got = placed(doc)

    assert got["option"] == "l4-on-demand" and got["priority"] == "cairn-on-demand"
    assert got["selector"] == {"cloud.google.com/gke-provisioning": "standard"}
    assert not any(t.get("key") == "cloud.google.com/gke-spot" for t in got["tolerations"])
    assert "2 preemptions" in op.cairn_plan.placement.reason
    assert doc["metadata"]["labels"]["try_number"] == "3"
    # Scheduled maintenance is avoided through the affinity the transform ANDs in.
    terms = doc["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "cloud.google.com/scheduled-maintenance-time",
            "operator": "DoesNotExist"} in terms[0]["matchExpressions"]
    kubernetes_validate.validate(doc, "1.29", strict=True)


def test_image_digest_helpers() -> None:
    assert image_repository("repo/train:1.0") == "repo/train"
    assert image_repository("localhost:5000/team/train:1.0") == "localhost:5000/team/train"
    assert image_repository("localhost:5000/train") == "localhost:5000/train"
    assert image_repository(f"repo/train@{DIGEST}") == "repo/train"
    assert digest_of(f"docker.io/repo/train@{DIGEST}") == DIGEST
    assert digest_of(f"docker-pullable://repo/train@{DIGEST}") == DIGEST
    assert digest_of(DIGEST) is None  # a local image ID: no registry can serve it
    assert digest_of("repo/train@sha256:short") is None
    assert pin_image("localhost:5000/train:1.0", DIGEST) == f"localhost:5000/train@{DIGEST}"
    with pytest.raises(ConfigError, match="digest"):
        pin_image("repo/train:1.0", "latest")


def running_pod(image_id: str) -> k8s.V1Pod:
    return k8s.V1Pod(status=k8s.V1PodStatus(phase="Running", container_statuses=[
        k8s.V1ContainerStatus(name="cairn-sidecar", image="s", image_id=f"s@{'cd' * 32}",
                              ready=True, restart_count=0),
        k8s.V1ContainerStatus(name="base", image="repo/train:1.0", image_id=image_id,
                              ready=True, restart_count=0)]))


def test_retries_run_the_first_pods_image_digest(kubeconfig: str, store_url: str) -> None:
    state = FakeTaskStateStore()
    first = make_operator(kubeconfig, store_url)
    context = context_for(first, state=state)
    assert container(manifest(first.build_pod_request_obj(context)), "base")["image"] == \
        "repo/train:1.0"
    assert image_digest_from_pod(running_pod(f"docker.io/repo/train@{DIGEST}"), "base") == DIGEST
    first.record_image_digest(context, running_pod(f"docker.io/repo/train@{DIGEST}"))
    # A later try's record does not move the pin.
    first.record_image_digest(context, running_pod(f"docker.io/repo/train@sha256:{'ef' * 32}"))
    assert state.values[IMAGE_STATE_KEY] == {"image": "repo/train:1.0", "digest": DIGEST}

    retry = make_operator(kubeconfig, store_url)
    doc = manifest(retry.build_pod_request_obj(context_for(retry, try_number=2, state=state)))
    assert container(doc, "base")["image"] == f"repo/train@{DIGEST}"
    kubernetes_validate.validate(doc, "1.29", strict=True)

    # A DAG whose image reference changed since the first try is not pinned to the old digest.
    changed = make_operator(kubeconfig, store_url, image="repo/train:2.0")
    doc = manifest(changed.build_pod_request_obj(context_for(changed, try_number=3, state=state)))
    assert container(doc, "base")["image"] == "repo/train:2.0"


def ended_pod(*, exit_code: int | None = None, reason: str | None = None,
              pod_reason: str | None = None, disruption: bool = False) -> k8s.V1Pod:
    terminated = k8s.V1ContainerStateTerminated(exit_code=exit_code, reason=reason) \
        if exit_code is not None else None
    conditions = [k8s.V1PodCondition(type="DisruptionTarget", status="True",
                                     reason="TerminationByKubelet")] if disruption else None
    status = k8s.V1ContainerStatus(name="base", image="i", image_id="", ready=False,
                                   restart_count=0,
                                   state=k8s.V1ContainerState(terminated=terminated))
    return k8s.V1Pod(spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base", image="i")]),
                     status=k8s.V1PodStatus(phase="Failed", reason=pod_reason,
                                            conditions=conditions, container_statuses=[status]))


@pytest.mark.parametrize("pod, expected", [
    (ended_pod(exit_code=75, reason="Error"), Preempted),
    (ended_pod(exit_code=76, reason="Error"), Preempted),
    (ended_pod(exit_code=5, reason="Error"), Fenced),
    (ended_pod(exit_code=1, reason="Error"), None),
    (ended_pod(exit_code=0, reason="Completed"), None),
    (ended_pod(exit_code=137, reason="OOMKilled", disruption=True), None),
    (ended_pod(exit_code=143, reason="Error", pod_reason="Terminated"), Preempted),
    (ended_pod(exit_code=137, reason="Error", disruption=True), Preempted),
    (ended_pod(pod_reason="Evicted"), Preempted),
    (ended_pod(exit_code=8, reason="Error"), RestoreFailed),
], ids=["75", "76", "5", "1", "0", "oom", "node-shutdown", "disruption", "evicted", "8"])
def test_how_a_finished_pod_maps_to_cairn_errors(pod: k8s.V1Pod, expected: type | None) -> None:
    error = pod_end_error(pod, "base")
    assert (None if error is None else type(error)) is expected


class FakeKubernetesApi:
    """Stands in for the Kubernetes API server (none can run here), on 127.0.0.1: it serves one
    finished pod for Airflow's cleanup (read, label patch, delete, events) and records the
    requests."""

    def __init__(self, pod: dict[str, Any]) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.pod, self.requests = pod, []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                api.requests.append((self.command, self.path.split("?")[0]))
                body = {"kind": "EventList", "apiVersion": "v1", "items": []} \
                    if "/events" in self.path else api.pod
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_DELETE = _reply

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def cleanup_after(kubeconfig_for: Callable[[str], str], store_url: str, pod: k8s.V1Pod, *,
                  prepare: Callable[[Any], None] = lambda key: None,
                  seen: list[tuple[str, str]] | None = None, forget_plan: bool = False,
                  **options: Any) -> None:
    """Build this try's pod (its plan reads the store ``prepare(key)`` filled), then run
    Airflow's cleanup for ``pod`` ended as it is, against a fake API server serving it; the
    API requests made go to ``seen``. ``forget_plan``: the cleanup runs on an operator that
    did not build the pod (the KPO's deferrable mode resumed elsewhere). Raises what the
    cleanup raised."""
    pod.metadata = k8s.V1ObjectMeta(name="train-abc", namespace="training", labels={})
    api = FakeKubernetesApi({"apiVersion": "v1", "kind": "Pod", **manifest(pod)})
    try:
        op = make_operator(kubeconfig_for(api.url), store_url, **options)
        context = context_for(op)
        prepare(task_key(context))
        op.build_pod_request_obj(context)
        if forget_plan:
            op.cairn_plan = None
        op.cleanup(pod=pod, remote_pod=pod, context=context)
    finally:
        api.close()
        if seen is not None:
            seen.extend(api.requests)


def test_a_pod_the_node_ended_is_preempted_and_leaves_its_outcome(kubeconfig_for: Any,
                                                                  store_url: str) -> None:
    from datetime import datetime, timezone

    pod = ended_pod(exit_code=137, reason="Error", disruption=True)
    pod.status.start_time = datetime.now(timezone.utc) - timedelta(seconds=5)
    attempts: dict[str, Any] = {}

    def earlier_try_then_this_pods(key: Any) -> None:
        attempts["key"] = key
        with open_store(store_url) as store:
            old = store.open_attempt(key)      # an earlier try, before this pod started
            store.records.record_outcome(key, Outcome(epoch=old.epoch, outcome=OutcomeKind.PREEMPTED,
                                              started_at=time.time() - 60,
                                              ended_at=time.time() - 30, option=SPOT.name))
            attempts["mine"] = store.open_attempt(key)  # what `cairn run` opens in this pod

    with pytest.raises(Preempted) as raised:
        cleanup_after(kubeconfig_for, store_url, pod, prepare=earlier_try_then_this_pods,
                      placement=[SPOT, ON_DEMAND])
    assert "returned a failure" in str(raised.value.__cause__)  # Airflow's verdict, mapped
    key, mine = attempts["key"], attempts["mine"]
    with open_store(store_url) as store:
        outcomes = {o.epoch: o for o in store.records.outcomes(key)}
        assert outcomes[mine.epoch].outcome is OutcomeKind.PREEMPTED
        assert outcomes[mine.epoch].option == "l4-spot"
        assert outcomes[mine.epoch].detail["disruption"] == "TerminationByKubelet"
        assert len(outcomes) == 2
        # Once recorded, a second look neither overwrites nor adds a record.
        assert record_pod_outcome(store, key, pod, "base") is None


def test_a_failed_pod_is_deleted_and_stays_an_airflow_failure(kubeconfig_for: Any,
                                                               store_url: str) -> None:
    from airflow.providers.common.compat.sdk import AirflowException

    seen: list[tuple[str, str]] = []
    with pytest.raises(AirflowException, match="returned a failure"):
        cleanup_after(kubeconfig_for, store_url, ended_pod(exit_code=1, reason="Error"),
                      seen=seen)
    assert ("DELETE", "/api/v1/namespaces/training/pods/train-abc") in seen


def _tries(store_url: str, key: Any, kinds: list[OutcomeKind | None], *,
           resumed_from_first_snapshot: bool = False) -> list[int]:
    """Earlier tries of ``key``: the first commits a snapshot; each later one (if asked)
    resumes from it and commits nothing. Returns the snapshot seqs."""
    import os

    seqs = []
    with open_store(store_url) as store:
        for index, kind in enumerate(kinds):
            attempt = store.open_attempt(key)
            if index == 0:
                data = os.urandom(64)
                with attempt.snapshot() as snap:
                    snap.add_bytes("state", data)
                    seqs.append(snap.commit().seq)
            if kind is not None:
                store.records.record_outcome(key, Outcome(epoch=attempt.epoch, outcome=kind,
                                                  started_at=time.time() - 60,
                                                  ended_at=time.time() - 30))
    return seqs


def test_the_loop_guards_verdict_reaches_the_pod_as_excluded_seqs(kubeconfig: str,
                                                                   store_url: str) -> None:
    op = make_operator(kubeconfig, store_url)
    context = context_for(op)
    key = task_key(context)
    # Try 1 committed a snapshot; tries 2 and 3 resumed from it and died without a record.
    seqs = _tries(store_url, key, [OutcomeKind.PREEMPTED, None, None])
    doc = manifest(op.build_pod_request_obj(context_for(op, try_number=4)))
    env = {e["name"]: e.get("value") for e in container(doc, "base").get("env", [])}
    assert env["CAIRN_EXCLUDE_SEQS"] == str(seqs[0])
    assert "loop guard" in op.cairn_plan.resume.reason  # type: ignore[union-attr]
    fresh = make_operator(kubeconfig, store_url, loop_guard=False)
    doc = manifest(fresh.build_pod_request_obj(context_for(fresh, try_number=4)))
    assert "CAIRN_EXCLUDE_SEQS" not in {e["name"] for e in container(doc, "base").get("env", [])}


def _committed_pod(seq: int, *, sidecar_running: bool, url: str, key: str) -> k8s.V1Pod:
    """The operator's ended pod whose annotation keeps ``seq`` (as its sidecar patches it),
    its sidecar still running or ended."""
    from cairn.k8s import COMMITTED_SEQS_ANNOTATION, SIDECAR_NAME, render_committed_seqs

    pod = ended_pod(exit_code=0, reason="Completed")
    pod.status.phase = "Succeeded"
    pod.metadata = k8s.V1ObjectMeta(
        name="train-abc", namespace="training", labels={},
        annotations={COMMITTED_SEQS_ANNOTATION: render_committed_seqs({(url, key): seq})})
    state = (k8s.V1ContainerState(running=k8s.V1ContainerStateRunning()) if sidecar_running
             else k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=0)))
    pod.status.init_container_statuses = [k8s.V1ContainerStatus(
        name=SIDECAR_NAME, image="s", image_id="", ready=True, restart_count=0, state=state)]
    return pod


def test_the_committed_seq_goes_from_the_task_state_store_to_the_next_pod_and_back(
        kubeconfig_for: Any, store_url: str) -> None:
    """Rollback refused across the operator's pods (ADR 0049): the seq an earlier try kept
    in the task state store is the new pod's annotation, which its sidecar copies into the
    pod's files (``--owner-pod``); once the pod has ended, the seq its sidecar last patched
    there is kept in the task state store, read after the sidecar has ended. The API server
    is a FAKE (none can run here)."""
    from cairn.k8s import COMMITTED_SEQS_ANNOTATION, SIDECAR_NAME, render_committed_seqs
    from cairn.runtime.rollback import local_mark
    from cairn_airflow.committed import TASK_STATE_KEY

    state = FakeTaskStateStore()
    probe = make_operator(kubeconfig_for("http://127.0.0.1:9"), store_url)
    key = str(task_key(context_for(probe)))
    url = local_mark(store_url, key).store_url  # the canonical form every side files under
    state.values[TASK_STATE_KEY] = {"store": url, "key": key, "seq": 7}
    # The pod as the worker last saw it (sidecar still publishing), and as the API serves it
    # once the sidecar has patched the final snapshot's seq and ended.
    seen = _committed_pod(12, sidecar_running=True, url=url, key=key)
    final = _committed_pod(13, sidecar_running=False, url=url, key=key)
    api = FakeKubernetesApi({"apiVersion": "v1", "kind": "Pod", **manifest(final)})
    try:
        op = make_operator(kubeconfig_for(api.url), store_url)
        context = context_for(op, state=state)
        doc = manifest(op.build_pod_request_obj(context))
        assert doc["metadata"]["annotations"][COMMITTED_SEQS_ANNOTATION] == \
            render_committed_seqs({(url, key): 7})
        assert "--owner-pod" in container(doc, SIDECAR_NAME)["args"]
        op.cleanup(pod=seen, remote_pod=seen, context=context)
    finally:
        api.close()
    assert state.values[TASK_STATE_KEY] == {"store": url, "key": key, "seq": 13}
    assert ("GET", "/api/v1/namespaces/training/pods/train-abc") in api.requests

    # A first try: nothing kept, no annotation to seed.
    fresh = make_operator(kubeconfig_for("http://127.0.0.1:9"), store_url)
    doc = manifest(fresh.build_pod_request_obj(context_for(fresh)))
    assert COMMITTED_SEQS_ANNOTATION not in (doc["metadata"].get("annotations") or {})


@pytest.mark.parametrize("forget_plan", [False, True], ids=["built-here", "built-elsewhere"])
@pytest.mark.parametrize(("code", "error", "says"), [
    (8, RestoreFailed, "no snapshot was skipped"),
    (9, RollbackRefused, "CAIRN_ALLOW_ROLLBACK=1"),  # a retry would refuse the same
], ids=["restore-failed", "rollback-refused"])
def test_a_pod_whose_restore_failed_on_its_side_fails_without_a_retry(
        kubeconfig_for: Any, store_url: str, forget_plan: bool, code: int,
        error: type[Exception], says: str) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=says) as raised:
        cleanup_after(kubeconfig_for, store_url, ended_pod(exit_code=code, reason="Error"),
                      forget_plan=forget_plan)
    assert isinstance(raised.value.__cause__, error)


def test_a_pod_that_fails_past_max_error_retries_stops_the_retries(
        kubeconfig_for: Any, kubeconfig: str, store_url: str) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    def one_error_before(key: Any) -> None:
        _tries(store_url, key, [OutcomeKind.FAILED])

    with pytest.raises(AirflowFailException, match="max_error_retries=1; not retrying"):
        cleanup_after(kubeconfig_for, store_url, ended_pod(exit_code=1, reason="Error"),
                      prepare=one_error_before, max_error_retries=1)
    # A step past the limit gets no pod at all.
    op = make_operator(kubeconfig, store_url, max_error_retries=0)
    with pytest.raises(AirflowFailException, match="more than max_error_retries=0"):
        op.build_pod_request_obj(context_for(op, try_number=3))


def test_a_preempted_pod_is_rescheduled_without_consuming_a_retry(kubeconfig_for: Any,
                                                                  store_url: str) -> None:
    from airflow.sdk.exceptions import AirflowRescheduleException

    from datetime import datetime, timezone

    from cairn_airflow.resume import MIN_RESCHEDULE_DELAY

    before = datetime.now(tz=timezone.utc)
    with pytest.raises(AirflowRescheduleException) as raised:
        cleanup_after(kubeconfig_for, store_url, ended_pod(exit_code=75, reason="Error"),
                      max_preemptions=1, retry_delay=timedelta(seconds=7))
    assert isinstance(raised.value.__cause__, Preempted)
    # Never sooner than the floor (a 7 s retry_delay is raised to it).
    assert raised.value.reschedule_date >= before + MIN_RESCHEDULE_DELAY
    # max_preemptions spent: the next preemption is a plain (retried) Preempted.
    with pytest.raises(Preempted):
        cleanup_after(kubeconfig_for, store_url, ended_pod(exit_code=75, reason="Error"),
                      prepare=lambda key: _tries(store_url, key, [OutcomeKind.PREEMPTED]),
                      max_preemptions=1)


@pytest.mark.parametrize("forget_plan", [False, True], ids=["built-here", "built-elsewhere"])
def test_a_pod_that_ended_suspended_is_deleted_and_the_task_defers(
        kubeconfig_for: Any, store_url: str, forget_plan: bool) -> None:
    """Exit 77 (issue 19): the pod is cleaned up as usual, then the task defers with the resume
    trigger for the suspended try instead of failing; nothing is left running."""
    from airflow.sdk.exceptions import TaskDeferred

    from cairn_airflow.triggers import CairnResumeTrigger

    tried: dict[str, Any] = {}

    def suspended_in_the_pod(key: Any) -> None:
        with open_store(store_url) as store:
            tried["key"], tried["epoch"] = str(key), store.open_attempt(key).epoch
            store.records.request_suspend(key, by="operator", reason="GPUs needed")
            store.records.record_outcome(key, Outcome(epoch=tried["epoch"],
                                              outcome=OutcomeKind.SUSPENDED,
                                              started_at=time.time() - 30,
                                              ended_at=time.time()))

    seen: list[tuple[str, str]] = []
    with pytest.raises(TaskDeferred) as raised:
        cleanup_after(kubeconfig_for, store_url, ended_pod(exit_code=77, reason="Error"),
                      prepare=suspended_in_the_pod, seen=seen, resume_poll=2,
                      forget_plan=forget_plan)
    deferred = raised.value
    assert deferred.method_name == "resume_suspended" and deferred.timeout is None
    assert isinstance(deferred.trigger, CairnResumeTrigger)
    kwargs = deferred.trigger.serialize()[1]
    assert kwargs.pop("not_before") > time.time() + 10  # clear of the scheduler's event read
    assert kwargs == {"store_url": store_url, "key": tried["key"], "epoch": tried["epoch"],
                      "resume_after": None, "poll_seconds": 2.0, "secret_file": None}
    assert ("DELETE", "/api/v1/namespaces/training/pods/train-abc") in seen


def test_pod_status_to_outcome_kind() -> None:
    assert outcome_from_pod(ended_pod(exit_code=137, reason="OOMKilled"), "base") is \
        OutcomeKind.FAILED
    assert outcome_from_pod(ended_pod(pod_reason="Evicted"), "base") is OutcomeKind.EVICTED
    assert outcome_from_pod(ended_pod(exit_code=143, pod_reason="Terminated"), "base") is \
        OutcomeKind.PREEMPTED
    assert outcome_from_pod(ended_pod(exit_code=1, reason="Error"), "base") is None


def test_on_kill_deletes_the_pod_with_the_grace_the_final_snapshot_needs(
        kubeconfig: str, store_url: str) -> None:
    op = make_operator(kubeconfig, store_url, termination_grace_period=5,
                       final_snapshot_s=40.0, on_kill_action="keep_pod")
    op.pod = op.build_pod_request_obj(context_for(op))
    assert op.pod.spec.termination_grace_period_seconds == 50
    op.on_kill()   # keep_pod: nothing is sent to the (absent) API server
    assert op.termination_grace_period == 50


def test_bad_settings_are_refused_with_the_fix(kubeconfig: str, store_url: str) -> None:
    with pytest.raises(ConfigError, match="reattach"):
        make_operator(kubeconfig, store_url, reattach_on_restart=False)
    with pytest.raises(ConfigError, match="1.29 or later"):
        make_operator(kubeconfig, store_url, kubernetes_version="1.28")
    with pytest.raises(ConfigError, match="not pinned"):
        op = make_operator(kubeconfig, store_url, sidecar_image="repo/cairn-sidecar")
        op.build_pod_request_obj(context_for(op))


def test_importing_the_module_pulls_in_neither_torch_nor_criu() -> None:
    import subprocess

    code = ("import sys, cairn_airflow.kubernetes; "
            "bad = [m for m in sys.modules if m in ('torch', 'numpy') "
            "or m.startswith('cairn.process') or m.startswith('cairn.state.checkpointer')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_example_dag_renders_its_pod(kubeconfig: str, store_url: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from airflow.dag_processing.dagbag import DagBag

    repo = Path(__file__).resolve().parents[3]
    bag = DagBag(dag_folder=str(repo / "dags" / "kubernetes_training.py"))
    assert not bag.import_errors, bag.import_errors
    op = bag.dags["cairn_kubernetes_training"].get_task("train")
    op.store_url, op.config_file, op.in_cluster = store_url, kubeconfig, False
    doc = manifest(op.build_pod_request_obj(context_for(op)))
    base = container(doc, "base")
    assert base["command"][:2] == ["cairn", "run"]
    assert base["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert doc["spec"]["priorityClassName"] == "cairn-spot"
    kubernetes_validate.validate(doc, "1.29", strict=True)
    # Airflow's dry run (no task instance, no cluster credentials) shows the same cairn pod.
    op.dry_run()
    printed = capsys.readouterr().out
    assert "cairn-sidecar" in printed and "dry-run" in printed


# -- moving a suspended pod-based step (issue 19 item 4) ----------------------------------------

ROOT = Path(__file__).resolve().parents[3]
# What the pod's main container gets from its spec and the test passes to the process that
# stands in for it (the transform's channel paths name the pod's shared volume, not here).
_PASSED = ("CAIRN_STORE", "CAIRN_KEY", "CAIRN_EVERY_SECONDS", "CAIRN_PLACEMENT_OPTION",
           "CAIRN_PLACEMENT_REASON", "CAIRN_PLACEMENT_OPTIONS")


def _main_container(doc: dict[str, Any], *, pace: float) -> Any:
    """The pod's main container as a real process: a state-mode torch training try
    (``tests.support.try_training``) with the pod spec's cairn environment."""
    import os
    import subprocess

    values = {e["name"]: e["value"] for e in container(doc, "base").get("env", [])
              if e["name"] in _PASSED and "value" in e}
    environ = {**os.environ, **values, "CAIRN_SUSPEND_POLL": "0.2s"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.try_training", values["CAIRN_STORE"],
         values["CAIRN_KEY"], "--total", "30", "--every", "2", "--pace", str(pace)],
        cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _cairn(*args: str, check: int = 0) -> Any:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "cairn.cli.main", *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == check, (proc.stdout, proc.stderr)
    return proc


@pytest.mark.slow
def test_a_suspended_pod_step_resumes_on_the_placement_the_resume_names(
        kubeconfig_for: Any, kubeconfig: str, store_url: str) -> None:
    """Suspend a pod-based step mid-run (its main container a real training process), see the
    task defer (Airflow's cleanup against a fake API server), resume it with ``cairn resume
    --placement``: the continuation's pod is built on that option, and the new try's outcome
    record names the option and who moved it there."""
    from airflow.sdk.exceptions import TaskDeferred

    options = dict(placement=[SPOT, ON_DEMAND], mode="state")
    op = make_operator(kubeconfig, store_url, **options)
    context = context_for(op)
    key = str(task_key(context))
    first = manifest(op.build_pod_request_obj(context))
    assert placed(first)["option"] == SPOT.name  # no history: spot
    proc = _main_container(first, pace=0.05)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("committed 3"):
            _cairn("suspend", store_url, key, "--reason", "GPUs needed")
            break
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 77, out  # suspended: its final snapshot taken

    with pytest.raises(TaskDeferred):  # the pod ended 77: the task waits, its pod deleted
        cleanup_after(kubeconfig_for, store_url, ended_pod(exit_code=77, reason="Error"),
                      **options)

    wrong = _cairn("resume", store_url, key, "--placement", "h100", check=2)
    assert "not one of the step's capacity options (l4-spot, l4-on-demand)" in wrong.stderr
    moved = _cairn("resume", store_url, key, "--placement", ON_DEMAND.name, "--json")
    by = json.loads(moved.stdout)["by"]
    [listed] = json.loads(_cairn("ls", store_url, "--json").stdout)
    assert listed["state"] == "resume-requested"
    assert listed["suspension"]["placement"] == ON_DEMAND.name
    assert f"on capacity option {ON_DEMAND.name}" in _cairn("ls", store_url).stdout

    # The continuation (resume_suspended -> execute) builds its pod: on the named option.
    again = make_operator(kubeconfig, store_url, **options)
    second = manifest(again.build_pod_request_obj(context_for(again)))
    got = placed(second)
    assert got["option"] == ON_DEMAND.name and got["priority"] == "cairn-on-demand"
    assert got["selector"] == {"cloud.google.com/gke-provisioning": "standard"}
    assert not any(t.get("key") == "cloud.google.com/gke-spot" for t in got["tolerations"])
    reason = again.cairn_plan.placement.reason  # type: ignore[union-attr]
    assert reason.startswith(f"moved by resume request from {by}: {ON_DEMAND.name}")
    kubernetes_validate.validate(second, "1.29", strict=True)

    proc = _main_container(second, pace=0.0)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    start = int(next(line for line in out.splitlines() if line.startswith("start ")).split()[1])
    assert start >= 4  # resumed from the suspend snapshot, not from the start
    with open_store(store_url) as store:
        suspended, resumed = store.records.outcomes(task_key(context))
    assert suspended.outcome is OutcomeKind.SUSPENDED and suspended.option == SPOT.name
    assert suspended.options == (SPOT.name, ON_DEMAND.name)
    assert resumed.outcome is OutcomeKind.SUCCEEDED and resumed.option == ON_DEMAND.name
    assert resumed.reason == reason


def test_a_step_on_an_airflow_worker_cannot_be_moved(store_url: str) -> None:
    """A try that recorded no capacity options (what a step on a worker records) is refused a
    placement, with why; the resume without one goes through."""
    with open_store(store_url) as store:
        key = Key(("dag", "on_a_worker", "run", "-1"))
        attempt = store.open_attempt(key)
        store.records.request_suspend(key, by="ops")
        store.records.record_outcome(key, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.SUSPENDED,
                                          started_at=time.time() - 5, ended_at=time.time()))
    refused = _cairn("resume", store_url, str(key), "--placement", ON_DEMAND.name, check=2)
    assert ("Airflow has no call that changes a task instance's queue or pool"
            in refused.stderr)
    _cairn("resume", store_url, str(key))
