"""``with_snapshot_sidecar`` on a Job (batch/v1, strict kubernetes-validate, 1.29 and newest) and
a JobSet (jobset.x-k8s.io/v1alpha2, its vendored CRD schema): each pod's key is
(namespace, Job, completion index), built in the pod from the downward API and ``$(VAR)``
expansion, which these tests carry out as the kubelet does for a given pod."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from kubernetes import client as k8s
from kubernetes_validate.utils import latest_version

from cairn.exceptions import ConfigError
from cairn.k8s import with_snapshot_sidecar
from cairn.k8s.job_templates import COMPLETION_INDEX_ANNOTATION, INDEX_ENV, JOB_NAME_LABEL
from cairn.k8s.committed import STARTED_PATH
from cairn.k8s.jobs import JobSettings
from cairn.k8s.transform import METRICS_PORT, SHARED_PATH, SIDECAR_NAME, _to_model
from cairn.runtime.env import COMMITTED_DIR
from cairn.store import Key
from tests.unit.k8s import crd_schemas
from tests.unit.k8s.pod_checks import semantic_problems

IMAGE = "registry.example/cairn-sidecar:0.1.0"
VERSIONS = ["1.29", latest_version()]


def _template(name: str = "train") -> dict[str, Any]:
    return {"metadata": {"labels": {"app": name}}, "spec": {
        "restartPolicy": "Never",
        "containers": [{"name": name, "image": "registry.example/train:1.4",
                        "command": ["python", "train.py"], "args": ["--epochs", "3"],
                        "resources": {"limits": {"memory": "8Gi"}}}]}}


def _job(*, indexed: bool = True, completions: int = 4, parallelism: int = 4) -> dict[str, Any]:
    spec: dict[str, Any] = {"completions": completions, "parallelism": parallelism,
                            "backoffLimit": 3, "template": _template()}
    if indexed:
        spec["completionMode"] = "Indexed"
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "namespace": "ml"}, "spec": spec}


def _jobset() -> dict[str, Any]:
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "llm", "namespace": "ml"},
            "spec": {"replicatedJobs": [
                {"name": "workers", "replicas": 2, "template": {"spec": {
                    "parallelism": 2, "completions": 2, "backoffLimit": 0,
                    "template": _template()}}},
                {"name": "coordinator", "replicas": 1, "template": {"spec": {
                    "template": _template("coord")}}}]}}


def _options(mode: str, **extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"store": "gs://bucket/cairn", "mode": mode, "sidecar_image": IMAGE}
    if mode == "process":
        options["state_bytes"] = "6Gi"
    return {**options, **extra}


def _expand(container: dict[str, Any], pod_meta: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The container's argv and env once the kubelet resolved the downward API (for a pod with
    ``pod_meta``) and expanded ``$(VAR)``: env values see the variables before them, command and
    args see all; an undefined ``$(VAR)`` stays as it is."""
    values: dict[str, str] = {}

    def expand(text: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: values.get(m.group(1), m.group(0)), text)

    for e in container.get("env") or []:
        if "value" in e:
            values[e["name"]] = expand(e["value"])
            continue
        path = e["valueFrom"]["fieldRef"]["fieldPath"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if path == "metadata.namespace":
            values[e["name"]] = pod_meta["namespace"]
        elif path == "metadata.name":
            values[e["name"]] = pod_meta["name"]
        elif path == "spec.nodeName":
            values[e["name"]] = "node-a"
        else:
            assert m, path
            values[e["name"]] = pod_meta[m.group(1)].get(m.group(2), "")
    argv = [expand(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    return argv, values


def _pod_meta(job: str, index: int | None) -> dict[str, Any]:
    annotations = {} if index is None else {COMPLETION_INDEX_ANNOTATION: str(index)}
    return {"namespace": "ml", "labels": {JOB_NAME_LABEL: job}, "annotations": annotations}


def _keys_in_pod(spec: dict[str, Any], meta: dict[str, Any], main: str) -> tuple[str, str]:
    """(the main container's key, the uploading sidecar's --key) as the pod sees them."""
    from cairn.cli.main import build_parser

    container = next(c for c in spec["containers"] if c["name"] == main)
    sidecar = next(c for c in spec["initContainers"] if c["name"] == SIDECAR_NAME)
    argv, env_values = _expand(container, meta)
    sidecar_argv, _ = _expand(sidecar, meta)
    side = build_parser().parse_args(sidecar_argv[1:])
    if argv[:2] == ["cairn", "run"]:
        return build_parser().parse_args(argv[1:]).key, side.upload_key
    return env_values["CAIRN_KEY"], side.upload_key


@pytest.mark.parametrize("mode", ["process", "state"])
@pytest.mark.parametrize("as_model", [False, True], ids=["dict", "V1Job"])
def test_an_indexed_job_validates_and_each_pod_gets_its_own_key(mode: str, as_model: bool) -> None:
    source = _job()
    given: Any = _to_model(source, "V1Job") if as_model else source
    before = copy.deepcopy(source)
    out = with_snapshot_sidecar(given, **_options(mode, secret_name="cairn-key"))
    assert source == before, "the input was modified"
    if as_model:
        assert isinstance(out, k8s.V1Job)
        out = k8s.ApiClient().sanitize_for_serialization(out)
    for version in VERSIONS:
        kubernetes_validate.validate(out, version, strict=True)
    spec = out["spec"]["template"]["spec"]
    assert semantic_problems({"spec": spec}, main="train") == []
    assert out["spec"]["completionMode"] == "Indexed" and out["metadata"] == before["metadata"]
    keys = {_keys_in_pod(spec, _pod_meta("train", i), "train") for i in range(4)}
    assert keys == {(f"ml/train/{i}", f"ml/train/{i}") if mode == "process"
                    else (f"ml/train/{i}", None) for i in range(4)}
    for main_key, _ in keys:
        Key.parse(main_key)
    # The lead's secret_name= still mounts the store's secret into the Job's pods.
    assert any(v.get("secret", {}).get("secretName") == "cairn-key" for v in spec["volumes"])


def test_a_one_pod_nonindexed_job_is_index_0_and_a_wide_one_is_refused() -> None:
    out = with_snapshot_sidecar(_job(indexed=False, completions=1, parallelism=1),
                                **_options("state"))
    spec = out["spec"]["template"]["spec"]
    assert _keys_in_pod(spec, _pod_meta("train", None), "train")[0] == "ml/train/0"
    kubernetes_validate.validate(out, "1.29", strict=True)
    with pytest.raises(ConfigError, match="set spec.completionMode: Indexed"):
        with_snapshot_sidecar(_job(indexed=False), **_options("state"))


def test_key_is_a_prefix_or_an_override() -> None:
    out = with_snapshot_sidecar(_job(), **_options("process", key="team/exp-7"))
    spec = out["spec"]["template"]["spec"]
    assert _keys_in_pod(spec, _pod_meta("train", 2), "train") == ("team/exp-7/train/2",) * 2
    own = f"exp-7/shard-$({INDEX_ENV})"
    out = with_snapshot_sidecar(_job(), **_options("state", key=own))
    spec = out["spec"]["template"]["spec"]
    assert _keys_in_pod(spec, _pod_meta("train", 3), "train")[0] == "exp-7/shard-3"


BAD: list[tuple[str, Any, dict[str, Any], str]] = [
    ("override without the index", _job(), {"key": "a/$(CAIRN_K8S_JOB)"},
     r"does not tell its pods apart: include \$\(CAIRN_K8S_COMPLETION_INDEX\)"),
    ("unknown variable", _job(), {"key": "a/$(HOSTNAME)/$(CAIRN_K8S_COMPLETION_INDEX)"},
     "names a variable cairn does not set"),
    ("bad prefix", _job(), {"key": "/"}, "empty key"),
    ("old apiVersion", {**_job(), "apiVersion": "batch/v1beta1"}, {},
     "cairn transforms batch/v1"),
    ("no template", {**_job(), "spec": {"completions": 1}}, {}, "has no spec.template.spec"),
    ("env taken", _job(), {}, r"already sets \['CAIRN_K8S_NAMESPACE'\]"),
    ("jobset override without the job", _jobset(),
     {"key": "a/$(CAIRN_K8S_COMPLETION_INDEX)"}, r"include \$\(CAIRN_K8S_JOB\) and"),
    ("unknown replicated job", _jobset(), {"replicated_jobs": ["ps"]},
     r"replicated_jobs=\['ps'\] are not in JobSet 'llm'"),
    ("two containers in a replicated job", _jobset(), {"container": "train"},
     "no container named 'train'; the pod has \\['coord'\\]"),
    ("a pod without a key", {"apiVersion": "v1", "kind": "Pod", "spec": _template()["spec"]},
     {}, "key= is required for a Pod"),
]
BAD[5][1]["spec"]["template"]["spec"]["containers"][0]["env"] = [
    {"name": "CAIRN_K8S_NAMESPACE", "value": "x"}]


@pytest.mark.parametrize("obj,changes,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error(obj: dict[str, Any], changes: dict[str, Any],
                                      message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        with_snapshot_sidecar(obj, **_options("state", **changes))


@pytest.mark.parametrize("mode", ["process", "state"])
def test_a_jobset_validates_against_its_crd_and_each_pod_gets_its_own_key(mode: str) -> None:
    source = _jobset()
    out = with_snapshot_sidecar(source, **_options(mode))
    assert source == _jobset(), "the input was modified"
    crd_schemas.validate(out)
    seen = set()
    for rjob in out["spec"]["replicatedJobs"]:
        main = rjob["name"] == "workers" and "train" or "coord"
        # Each replicated Job's template is a Job's spec: strict as a batch/v1 Job too.
        kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job",
                                      "metadata": {"name": "x"}, "spec": rjob["template"]["spec"]},
                                     "1.29", strict=True)
        assert rjob["template"]["spec"]["completionMode"] == "Indexed"  # JobSet's default, said
        spec = rjob["template"]["spec"]["template"]["spec"]
        assert semantic_problems({"spec": spec}, main=main) == []
        for replica in range(rjob["replicas"]):
            job = f"llm-{rjob['name']}-{replica}"  # how JobSet names its Jobs
            for index in range(rjob["template"]["spec"].get("completions") or 1):
                seen.add(_keys_in_pod(spec, _pod_meta(job, index), main)[0])
    assert seen == {"ml/llm-workers-0/0", "ml/llm-workers-0/1", "ml/llm-workers-1/0",
                    "ml/llm-workers-1/1", "ml/llm-coordinator-0/0"}


def test_a_jobset_can_leave_replicated_jobs_alone() -> None:
    out = with_snapshot_sidecar(_jobset(), **_options("state", replicated_jobs=["workers"]))
    crd_schemas.validate(out)
    workers, coordinator = out["spec"]["replicatedJobs"]
    assert "initContainers" in workers["template"]["spec"]["template"]["spec"]
    assert coordinator == _jobset()["spec"]["replicatedJobs"][1]


def test_the_crd_check_can_fail() -> None:
    out = with_snapshot_sidecar(_jobset(), **_options("state"))
    out["spec"]["replicatedJobs"][0]["replica"] = 2  # a misspelt field, pruned by the server
    with pytest.raises(jsonschema.ValidationError, match="'replica' was unexpected"):
        crd_schemas.validate(out)
    with pytest.raises(jsonschema.ValidationError):
        crd_schemas.validate({**_jobset(), "apiVersion": "jobset.x-k8s.io/v1alpha1"})


@pytest.mark.parametrize("version", VERSIONS)
def test_a_process_mode_job_sidecar_reads_its_job_with_the_generated_role(
        version: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from cairn.cli.main import build_parser
    from cairn.k8s import job_reader_rbac
    from cairn.k8s.sidecar_cli import _settings

    role, binding = job_reader_rbac(service_account="trainer", namespace="ml")
    # get: spec.suspend and the committed seqs before the main container starts; patch: keep them.
    assert role["rules"] == [{"apiGroups": ["batch"], "resources": ["jobs"],
                              "verbs": ["get", "patch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    for doc in (role, binding):
        kubernetes_validate.validate(doc, version, strict=True)
    with pytest.raises(ConfigError, match="is not a Kubernetes name"):
        job_reader_rbac(service_account="Trainer!", namespace="ml")

    out = with_snapshot_sidecar(_job(), **_options("process"))
    spec = out["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == SIDECAR_NAME)
    argv, sidecar_env = _expand(sidecar, _pod_meta("train", 1))
    args = build_parser().parse_args(argv[1:])
    assert args.owner_job == "ml/train"
    # The sidecar's environment, as the pod gives it: the committed-seq files it seeds and keeps.
    monkeypatch.setenv(COMMITTED_DIR.name, sidecar_env[COMMITTED_DIR.name])
    settings = _settings(argparse.Namespace(**{**vars(args), "shared": str(tmp_path),
                                               "kube_api": "https://10.0.0.1"}))
    assert (settings.job.namespace, settings.job.name) == ("ml", "train")
    assert settings.committed_dir == f"{SHARED_PATH}/committed"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="runs in a pod"):
        _settings(argparse.Namespace(**{**vars(args), "shared": str(tmp_path)}))
    # State mode's Checkpointer asks the sidecar too: the same argument, expanded the same way.
    state = with_snapshot_sidecar(_job(), **_options("state"))
    state_sidecar = next(c for c in state["spec"]["template"]["spec"]["initContainers"]
                         if c["name"] == SIDECAR_NAME)
    state_argv, _ = _expand(state_sidecar, _pod_meta("train", 1))
    assert build_parser().parse_args(state_argv[1:]).owner_job == "ml/train"


def _containers(spec: dict[str, Any], main: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return (next(c for c in spec["containers"] if c["name"] == main),
            next(c for c in spec["initContainers"] if c["name"] == SIDECAR_NAME))


@pytest.mark.parametrize("mode", ["process", "state"])
def test_a_job_pods_committed_seqs_are_shared_and_seeded_before_the_main_container(
        mode: str) -> None:
    """ADR 0049 across a Job's pods: both containers keep the committed-seq files on the
    shared volume, and the sidecar's startup probe holds the main container back until the
    sidecar has copied the Job's annotation there."""
    out = with_snapshot_sidecar(_job(), **_options(mode))
    for version in VERSIONS:
        kubernetes_validate.validate(out, version, strict=True)
    spec = out["spec"]["template"]["spec"]
    assert semantic_problems({"spec": spec}, main="train") == []
    main, sidecar = _containers(spec, "train")
    meta = _pod_meta("train", 2)
    for container in (main, sidecar):
        _, values = _expand(container, meta)
        assert values[COMMITTED_DIR.name] == f"{SHARED_PATH}/committed", container["name"]
        assert any(m["mountPath"] == SHARED_PATH and m["name"] == "cairn-shared"
                   for m in container["volumeMounts"])
    probe = sidecar["startupProbe"]
    assert probe["httpGet"] == {"path": STARTED_PATH, "port": METRICS_PORT}
    assert probe["periodSeconds"] == 1
    # The probe outlasts a Job read that times out, with room for the interpreter's start.
    timeout_s = JobSettings(namespace="ml", name="train", api_url="https://10.0.0.1").timeout_s
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 4 * timeout_s
    # A JobSet's replicated Jobs are Jobs too.
    jobset = with_snapshot_sidecar(_jobset(), **_options(mode))
    crd_schemas.validate(jobset)
    for rjob in jobset["spec"]["replicatedJobs"]:
        pod_spec = rjob["template"]["spec"]["template"]["spec"]
        _, side = _containers(pod_spec, pod_spec["containers"][0]["name"])
        assert side["startupProbe"] == probe


def test_a_pod_no_job_owns_keeps_its_files_where_they_were() -> None:
    """No owner Job, no annotation to seed from: nothing moves, nothing waits."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": _template()["spec"]}
    out = with_snapshot_sidecar(pod, key="team/run-1", **_options("process"))
    main, sidecar = _containers(out["spec"], "train")
    assert "startupProbe" not in sidecar and "--owner-job" not in sidecar["args"]
    assert COMMITTED_DIR.name not in {e["name"] for c in (main, sidecar)
                                      for e in c.get("env") or []}


@pytest.mark.parametrize("mode", ["process", "state"])
def test_a_bare_pod_keeps_its_committed_seqs_in_its_own_annotation_when_asked(
        mode: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``committed_in_pod=True`` (the Airflow pod operator's pods, ADR 0049): the files on the
    shared volume, the sidecar keeping them in its own pod's annotation (``--owner-pod``, the
    pod's namespace and name from the downward API) and holding the main container back
    until it has copied them from there."""
    import argparse

    from cairn.cli.main import build_parser
    from cairn.k8s import pod_annotator_rbac
    from cairn.k8s.jobs import OwnerKind
    from cairn.k8s.sidecar_cli import _settings

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": _template()["spec"]}
    out = with_snapshot_sidecar(pod, key="team/run-1", committed_in_pod=True,
                                **_options(mode))
    for version in VERSIONS:
        kubernetes_validate.validate(out, version, strict=True)
    main, sidecar = _containers(out["spec"], "train")
    meta = {"namespace": "ml", "name": "train-x7k2p", "labels": {}, "annotations": {}}
    for container in (main, sidecar):
        assert _expand(container, meta)[1][COMMITTED_DIR.name] == f"{SHARED_PATH}/committed"
    assert sidecar["startupProbe"]["httpGet"] == {"path": STARTED_PATH, "port": METRICS_PORT}
    argv, sidecar_env = _expand(sidecar, meta)
    args = build_parser().parse_args(argv[1:])
    assert (args.owner_pod, args.owner_job) == ("ml/train-x7k2p", None)
    monkeypatch.setenv(COMMITTED_DIR.name, sidecar_env[COMMITTED_DIR.name])
    settings = _settings(argparse.Namespace(**{**vars(args), "shared": str(tmp_path),
                                               "kube_api": "https://10.0.0.1"}))
    assert settings.job is None and settings.keeper is settings.pod
    assert (settings.pod.kind, settings.pod.describe) == (OwnerKind.POD, "Pod ml/train-x7k2p")
    with pytest.raises(ConfigError, match="--owner-job and --owner-pod: give one"):
        _settings(argparse.Namespace(**{**vars(args), "shared": str(tmp_path),
                                        "kube_api": "https://10.0.0.1",
                                        "owner_job": "ml/train"}))
    # The grant it needs, valid as a manifest.
    role, binding = pod_annotator_rbac(service_account="trainer", namespace="ml")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "patch"]}]
    for doc in (role, binding):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    # A Job's pods keep them in the Job's annotation: the option is refused there.
    with pytest.raises(ConfigError, match="committed_in_pod=True is for a Pod"):
        with_snapshot_sidecar(_job(), committed_in_pod=True, **_options(mode))


def test_a_job_whose_container_keeps_its_marks_elsewhere_is_refused() -> None:
    job = _job()
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": COMMITTED_DIR.name, "value": "/mnt/marks"}]
    with pytest.raises(ConfigError, match=f"already sets {COMMITTED_DIR.name}='/mnt/marks'"):
        with_snapshot_sidecar(job, **_options("state"))
