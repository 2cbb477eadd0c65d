"""``with_snapshot_sidecar``: strict schema validation with kubernetes-validate (1.29 and the
newest schema it ships), the semantic checks a schema misses, and an input that never changes."""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client as k8s
from kubernetes_validate.utils import latest_version

from cairn.exceptions import ConfigError
from cairn.k8s import (
    PodMode,
    Staging,
    grant_process_mode,
    node_reader_rbac,
    with_snapshot_sidecar,
)
from cairn.k8s.quantity import format_bytes, parse_bytes
from cairn.k8s.transform import (
    APPARMOR_ANNOTATION,
    GraceWarning,
    MAINTENANCE_LABEL,
    SHARED_PATH,
)
from tests.unit.k8s.pod_checks import semantic_problems

GiB, MiB = 2**30, 2**20
IMAGE = "registry.example/cairn-sidecar:0.1.0"
VERSIONS = ["1.29", latest_version()]


def _pod(*, gpu: bool = False, affinity: bool = False, grace: int | None = None) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": "4", "memory": "8Gi"},
                                 "limits": {"memory": "8Gi"}}
    if gpu:
        resources["requests"]["nvidia.com/gpu"] = "1"
        resources["limits"]["nvidia.com/gpu"] = "1"
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{
            "name": "train", "image": "registry.example/train:1.4",
            "command": ["python", "train.py"], "args": ["--epochs", "3"],
            "env": [{"name": "EPOCHS", "value": "3"}],
            "resources": resources,
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }],
        "volumes": [{"name": "data", "emptyDir": {}}],
    }
    if affinity:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]},
            ]}}}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train-0"}, "spec": spec}


def _as_v1pod(pod: dict[str, Any]) -> k8s.V1Pod:
    from cairn.k8s.transform import to_v1pod

    return to_v1pod(pod)


def _options(mode: str, gpu: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"store": "gs://bucket/cairn", "key": "dag/train/run-1",
                               "mode": mode, "sidecar_image": IMAGE}
    if mode == "process":
        options["state_bytes"] = "6Gi"
    if gpu:
        options["gpu_memory_bytes"] = "40Gi"
    return options


def _main(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "train")


@pytest.mark.parametrize("as_v1pod", [False, True], ids=["dict", "V1Pod"])
@pytest.mark.parametrize("mode", ["process", "state"])
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("avoid", [False, True], ids=["any-node", "avoid-maintenance"])
def test_output_is_valid_and_input_untouched(as_v1pod: bool, mode: str, gpu: bool,
                                              avoid: bool) -> None:
    source = _pod(gpu=gpu, affinity=avoid)
    given: Any = _as_v1pod(source) if as_v1pod else source
    before = given.to_dict() if as_v1pod else copy.deepcopy(given)

    out = with_snapshot_sidecar(given, avoid_maintenance=avoid, watch_node_label=avoid,
                                final_snapshot_s=12.0, **_options(mode, gpu))

    assert (given.to_dict() if as_v1pod else given) == before, "the input was modified"
    if as_v1pod:
        assert isinstance(out, k8s.V1Pod) and out is not given
        manifest = k8s.ApiClient().sanitize_for_serialization(out)
    else:
        assert isinstance(out, dict)
        manifest = out
    for version in VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)
    assert semantic_problems(manifest, main="train") == []


def test_the_newest_schema_is_newer_than_129() -> None:
    major, minor = (int(x) for x in latest_version().split(".")[:2])
    assert (major, minor) > (1, 29)


def test_the_schema_check_would_catch_a_native_sidecar_on_old_kubernetes() -> None:
    """The validation is not vacuous: 1.27 has no restartPolicy on init containers."""
    out = with_snapshot_sidecar(_pod(), **_options("state", False))
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(out, "1.27", strict=True)


def test_semantic_checks_catch_what_the_schema_misses() -> None:
    out = with_snapshot_sidecar(_pod(), **_options("process", False))
    broken = copy.deepcopy(out)
    _main(broken)["resources"]["limits"]["memory"] = "1Gi"
    broken["spec"]["initContainers"][0]["restartPolicy"] = "OnFailure"
    broken["spec"]["volumes"] = [v for v in broken["spec"]["volumes"] if v["name"] != "data"]
    kubernetes_validate.validate(broken, "1.29", strict=True)  # the schema is happy
    problems = semantic_problems(broken, main="train")
    assert any("undefined volume data" in p for p in problems)
    assert any("native sidecar" in p for p in problems)
    assert any("memory limit 1Gi" in p for p in problems)


def test_process_mode_wraps_the_command_with_the_pods_grace() -> None:
    out = with_snapshot_sidecar(_pod(grace=90), every="5m", **_options("process", False))
    main = _main(out)
    assert "args" not in main
    cmd = main["command"]
    assert cmd[:2] == ["cairn", "run"] and cmd[cmd.index("--") + 1:] == [
        "python", "train.py", "--epochs", "3"]
    opts = dict(zip(cmd[2:cmd.index("--"):2], cmd[3:cmd.index("--"):2]))
    assert opts == {"--store": "gs://bucket/cairn", "--key": "dag/train/run-1", "--every": "5m",
                    "--grace": "90s", "--workdir": f"{SHARED_PATH}/run",
                    "--notice-file": f"{SHARED_PATH}/notice.json",
                    "--status-file": f"{SHARED_PATH}/status.json"}
    assert out["spec"]["terminationGracePeriodSeconds"] == 90
    sidecar = out["spec"]["initContainers"][0]
    assert sidecar["args"][sidecar["args"].index("--shared") + 1] == SHARED_PATH


def test_the_commands_written_parse_with_the_real_cli(tmp_path: Path) -> None:
    from cairn.cli.main import build_parser
    from cairn.k8s.sidecar_cli import _settings

    out = with_snapshot_sidecar(_pod(grace=45), watch_node_label=True, grace_cap_s=15,
                                **_options("process", False))
    run = build_parser().parse_args(_main(out)["command"][1:])
    assert (run.run_store, run.key, run.grace) == ("gs://bucket/cairn", "dag/train/run-1", "45s")
    assert run.notice_file == f"{SHARED_PATH}/notice.json"
    assert run.cmd[run.cmd.index("--") + 1:] == ["python", "train.py", "--epochs", "3"]
    sidecar = out["spec"]["initContainers"][0]
    args = build_parser().parse_args(sidecar["args"])
    assert args.shared == SHARED_PATH
    # Resolved as in the pod, with the shared volume and the in-cluster API stood in for.
    settings = _settings(argparse.Namespace(**{**vars(args), "shared": str(tmp_path),
                                               "kube_api": "https://10.0.0.1",
                                               "node_name": "node-a"}))
    assert settings.metadata.preemption_window_s == 15.0
    assert settings.sigterm_window_s == 45.0 and settings.node is not None


def test_process_mode_sidecar_uploads_from_the_spool(tmp_path: Path) -> None:
    from cairn.cli.main import build_parser
    from cairn.k8s.sidecar_cli import _settings
    from cairn.k8s.transform import SPOOL_PATH, UPLOADER_RESOURCES

    out = with_snapshot_sidecar(_pod(), **_options("process", False))
    env = {e["name"]: e.get("value") for e in _main(out)["env"]}
    assert env == {"EPOCHS": "3", "CAIRN_SPOOL_DIR": SPOOL_PATH}
    assert SPOOL_PATH.startswith(SHARED_PATH + "/")  # on the shared volume, next to staging
    sidecar = out["spec"]["initContainers"][0]
    assert sidecar["resources"] == UPLOADER_RESOURCES
    args = build_parser().parse_args(sidecar["args"])
    settings = _settings(argparse.Namespace(**{**vars(args), "shared": str(tmp_path)}))
    assert settings.upload is not None
    assert (settings.upload.spool_dir, settings.upload.store, settings.upload.key) == (
        SPOOL_PATH, "gs://bucket/cairn", "dag/train/run-1")
    # `cairn run` reads the spool from the environment the pod gives it.
    run = build_parser().parse_args(_main(out)["command"][1:])
    assert run.no_spool is False
    # State mode: the Checkpointer's own writer process persists; the sidecar does not upload.
    state = with_snapshot_sidecar(_pod(), **_options("state", False))
    state_sidecar = state["spec"]["initContainers"][0]
    assert "--upload" not in state_sidecar["args"]
    assert state_sidecar["resources"]["requests"] == {"cpu": "20m", "memory": "64Mi"}
    assert "CAIRN_SPOOL_DIR" not in {e["name"] for e in _main(state)["env"]}


def _with_credentials(pod: dict[str, Any], path: str, *, mount: str | None) -> dict[str, Any]:
    main = _main(pod)
    main["env"] += [{"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": path},
                    {"name": "STORAGE_EMULATOR_HOST", "value": "http://gcs.test:4443"},
                    {"name": "GOOGLE_CLOUD_PROJECT",
                     "valueFrom": {"configMapKeyRef": {"name": "gcp", "key": "project"}}}]
    if mount is not None:
        pod["spec"]["volumes"].append({"name": "gcp-key", "secret": {"secretName": "gcp-key"}})
        main["volumeMounts"].append({"name": "gcp-key", "mountPath": mount, "readOnly": True})
    return pod


@pytest.mark.parametrize("version", VERSIONS)
def test_the_uploading_sidecar_gets_the_stores_credentials(version: str) -> None:
    pod = _with_credentials(_pod(), "/var/secrets/gcp/key.json", mount="/var/secrets/gcp")
    out = with_snapshot_sidecar(pod, **_options("process", False))
    sidecar = out["spec"]["initContainers"][0]
    assert [e["name"] for e in sidecar["env"]] == [
        "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT"]
    assert sidecar["env"][2]["valueFrom"] == {"configMapKeyRef": {"name": "gcp", "key": "project"}}
    assert {"name": "gcp-key", "mountPath": "/var/secrets/gcp", "readOnly": True} in \
        sidecar["volumeMounts"]
    kubernetes_validate.validate(out, version, strict=True)
    assert semantic_problems(out, main="train") == []
    # Not given to the sidecar in state mode, where it does not upload.
    state = with_snapshot_sidecar(pod, **_options("state", False))
    assert "env" not in state["spec"]["initContainers"][0]


def test_a_key_file_the_sidecar_cannot_see_is_refused() -> None:
    pod = _with_credentials(_pod(), "/etc/baked-into-the-image/key.json", mount=None)
    with pytest.raises(ConfigError, match="mount the key from a Secret volume, or use Workload"):
        with_snapshot_sidecar(pod, **_options("process", False))


def test_a_path_store_is_mounted_into_the_uploading_sidecar() -> None:
    pod = _pod()
    pod["spec"]["volumes"].append({"name": "snapshots",
                                   "persistentVolumeClaim": {"claimName": "snapshots"}})
    _main(pod)["volumeMounts"].append({"name": "snapshots", "mountPath": "/mnt/snapshots"})
    options = {**_options("process", False), "store": "/mnt/snapshots/cairn"}
    out = with_snapshot_sidecar(pod, **options)
    sidecar = out["spec"]["initContainers"][0]
    assert {"name": "snapshots", "mountPath": "/mnt/snapshots"} in sidecar["volumeMounts"]
    kubernetes_validate.validate(out, "1.29", strict=True)
    from cairn.k8s.store_access import StoreAccessWarning

    with pytest.warns(StoreAccessWarning, match="is not on a volume container 'train' mounts"):
        with_snapshot_sidecar(_pod(), **{**options, "store": "file:///mnt/elsewhere"})


def test_process_mode_security_is_adr_0008() -> None:
    out = with_snapshot_sidecar(_pod(), **_options("process", False))
    sc = _main(out)["securityContext"]
    assert sc["seccompProfile"] == {"type": "Unconfined"}
    assert sc["runAsUser"] == 0
    assert set(sc["capabilities"]["add"]) == {"SYS_ADMIN", "SYS_TIME", "NET_ADMIN", "SYS_PTRACE"}
    assert "allowPrivilegeEscalation" not in sc and "privileged" not in sc
    assert out["metadata"]["annotations"][APPARMOR_ANNOTATION + "train"] == "unconfined"
    assert not out["spec"].get("shareProcessNamespace")
    side = out["spec"]["initContainers"][0]["securityContext"]
    assert side["runAsNonRoot"] is True and side["capabilities"] == {"drop": ["ALL"]}


def test_grant_process_mode_gives_the_same_privileges_and_keeps_the_command() -> None:
    """For a container that starts `cairn run` itself (CairnRunOperator in a worker pod)."""
    pod = _pod()
    before = copy.deepcopy(pod)
    out = grant_process_mode(pod, container="train")
    assert pod == before
    wrapped = with_snapshot_sidecar(_pod(), **_options("process", False))
    assert _main(out)["securityContext"] == _main(wrapped)["securityContext"]
    assert out["metadata"]["annotations"] == {APPARMOR_ANNOTATION + "train": "unconfined"}
    assert _main(out)["command"] == _main(pod)["command"]
    for version in VERSIONS:
        kubernetes_validate.validate(out, version, strict=True)


@pytest.mark.parametrize(("change", "fix"), [
    (lambda p: p["spec"].update(shareProcessNamespace=True), "remove shareProcessNamespace"),
    (lambda p: _main(p).update(securityContext={"runAsUser": 1000}), "runAsUser: 0"),
    (lambda p: _main(p).update(securityContext={"capabilities": {"drop": ["SYS_PTRACE"]}}),
     "remove them from capabilities.drop"),
])
def test_grant_process_mode_refuses_what_contradicts_it(change: Any, fix: str) -> None:
    pod = _pod()
    change(pod)
    with pytest.raises(ConfigError, match=fix):
        grant_process_mode(pod, container="train")


def test_drop_all_adds_the_runtime_defaults_criu_needs() -> None:
    pod = _pod()
    _main(pod)["securityContext"] = {"capabilities": {"drop": ["ALL"], "add": ["NET_RAW"]}}
    out = with_snapshot_sidecar(pod, **_options("process", False))
    add = _main(out)["securityContext"]["capabilities"]["add"]
    assert add[0] == "NET_RAW" and {"SETPCAP", "SYS_CHROOT", "SYS_ADMIN"} <= set(add)


def test_state_mode_sets_the_environment_and_needs_no_privileges() -> None:
    out = with_snapshot_sidecar(_pod(), **_options("state", False))
    main = _main(out)
    assert main["command"] == ["python", "train.py"] and main["args"] == ["--epochs", "3"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env == {"EPOCHS": "3", "CAIRN_STORE": "gs://bucket/cairn", "CAIRN_KEY": "dag/train/run-1",
                   "CAIRN_NOTICE_FILE": f"{SHARED_PATH}/notice.json",
                   "CAIRN_STATUS_FILE": f"{SHARED_PATH}/status.json"}
    assert "securityContext" not in main
    assert "annotations" not in out["metadata"]


def test_memory_backed_staging_and_gpu_memory_raise_the_limit() -> None:
    out = with_snapshot_sidecar(_pod(gpu=True), **_options("process", True))
    volume = next(v for v in out["spec"]["volumes"] if v["name"] == "cairn-shared")
    staging = parse_bytes(volume["emptyDir"]["sizeLimit"])
    expected = -(-int((6 * GiB + 40 * GiB) * 1.10) // MiB) * MiB
    assert staging == expected and volume["emptyDir"]["medium"] == "Memory"
    resources = _main(out)["resources"]
    for section in ("requests", "limits"):
        assert parse_bytes(resources[section]["memory"]) == 8 * GiB + staging + 40 * GiB
    assert resources["limits"]["nvidia.com/gpu"] == "1"


def test_disk_staging_counts_only_the_gpu_copy() -> None:
    out = with_snapshot_sidecar(_pod(gpu=True), staging=Staging.DISK, staging_bytes="30Gi",
                                **_options("process", True))
    volume = next(v for v in out["spec"]["volumes"] if v["name"] == "cairn-shared")
    assert volume["emptyDir"] == {"sizeLimit": "30Gi"}
    assert parse_bytes(_main(out)["resources"]["limits"]["memory"]) == 48 * GiB


def test_state_mode_volume_carries_only_the_channel() -> None:
    out = with_snapshot_sidecar(_pod(gpu=True), **_options("state", True))
    volume = next(v for v in out["spec"]["volumes"] if v["name"] == "cairn-shared")
    assert volume["emptyDir"]["sizeLimit"] == "16Mi"
    # State mode's staging is the Checkpointer's own (in the process): only the volume counts.
    assert _main(out)["resources"]["limits"]["memory"] == format_bytes(8 * GiB + 16 * MiB)


def test_state_mode_counts_the_checkpointers_staging_buffer() -> None:
    out = with_snapshot_sidecar(_pod(), state_bytes="8Gi", **_options("state", False))
    # 8 GiB + the 16 MiB channel volume + 1.125 x 8 GiB of staging buffer.
    assert parse_bytes(_main(out)["resources"]["limits"]["memory"]) == 17 * GiB + 16 * MiB


def test_grace_covers_the_final_snapshot_and_warns_over_the_platform_cap() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = with_snapshot_sidecar(_pod(), final_snapshot_s=41.2, **_options("state", False))
    assert out["spec"]["terminationGracePeriodSeconds"] == 52  # ceil(41.2 + 10)
    kept = with_snapshot_sidecar(_pod(grace=300), final_snapshot_s=41.2,
                                 **_options("state", False))
    assert kept["spec"]["terminationGracePeriodSeconds"] == 300
    with pytest.warns(GraceWarning, match="gives a preempted pod 15s"):
        capped = with_snapshot_sidecar(_pod(), final_snapshot_s=8, grace_cap_s=15,
                                       **_options("process", False))
    assert capped["spec"]["terminationGracePeriodSeconds"] == 30
    args = capped["spec"]["initContainers"][0]["args"]
    assert args[args.index("--preemption-window") + 1] == "15s"


def test_maintenance_avoidance_is_anded_into_every_term() -> None:
    out = with_snapshot_sidecar(_pod(affinity=True), avoid_maintenance=True,
                                **_options("state", False))
    terms = out["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2
    for term, pool in zip(terms, ("a", "b")):
        assert term["matchExpressions"] == [
            {"key": "pool", "operator": "In", "values": [pool]},
            {"key": MAINTENANCE_LABEL, "operator": "DoesNotExist"}]
    plain = with_snapshot_sidecar(_pod(), **_options("state", False))
    assert "affinity" not in plain["spec"]


def test_node_label_watching_gets_the_node_name() -> None:
    out = with_snapshot_sidecar(_pod(), watch_node_label=True, on_gce=False,
                                **_options("state", False))
    sidecar = out["spec"]["initContainers"][0]
    assert "--watch-node-label" in sidecar["args"] and "--no-metadata" in sidecar["args"]
    assert sidecar["env"] == [{"name": "NODE_NAME",
                               "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]


def test_the_sidecar_goes_first_among_init_containers() -> None:
    pod = _pod()
    pod["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox:1.36",
                                      "command": ["true"]}]
    out = with_snapshot_sidecar(pod, **_options("state", False))
    assert [c["name"] for c in out["spec"]["initContainers"]] == ["cairn-sidecar", "fetch"]
    kubernetes_validate.validate(out, "1.29", strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_output_fits_a_job_that_ignores_preemption_exits(version: str) -> None:
    out = with_snapshot_sidecar(_pod(), **_options("process", False))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
           "spec": {"backoffLimit": 3,
                    "podFailurePolicy": {"rules": [
                        {"action": "Ignore", "onExitCodes": {
                            "containerName": "train", "operator": "In", "values": [75, 76]}},
                        {"action": "Ignore", "onPodConditions": [
                            {"type": "DisruptionTarget", "status": "True"}]}]},
                    "template": {"metadata": out["metadata"], "spec": out["spec"]}}}
    kubernetes_validate.validate(job, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_rbac_for_the_node_label_watcher_validates(version: str) -> None:
    role, binding = node_reader_rbac(service_account="trainer", namespace="ml")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    for doc in (role, binding):
        kubernetes_validate.validate(doc, version, strict=True)


def _with(change: Any) -> dict[str, Any]:
    pod = _pod()
    change(pod)
    return pod


BAD: list[tuple[str, Any, dict[str, Any], str]] = [
    ("unknown container", _pod(), {"container": "trainer"}, r"no container named 'trainer'"),
    ("two containers", _with(lambda p: p["spec"]["containers"].append(
        {"name": "other", "image": "x:1"})), {}, "say which runs the step with container="),
    ("unknown mode", _pod(), {"mode": "criu"}, "mode 'criu' is not one of"),
    ("no command", _with(lambda p: _main(p).pop("command")), {},
     "has no command: process mode wraps it"),
    ("gpu without size", _pod(gpu=True), {}, "give gpu_memory_bytes="),
    ("no staging size", _pod(), {"state_bytes": None}, "give staging_bytes="),
    ("latest image", _pod(), {"sidecar_image": "cairn-sidecar:latest"}, "is not pinned"),
    ("untagged image", _pod(), {"sidecar_image": "registry:5000/cairn-sidecar"}, "is not pinned"),
    ("empty key", _pod(), {"key": "/"}, "empty key"),
    ("bad store", _pod(), {"store": "ftp://x"}, r"unsupported store URL scheme 'ftp'.*gs://BUCKET/PREFIX, s3://BUCKET/PREFIX"),
    ("shared pid namespace", _with(lambda p: p["spec"].update(shareProcessNamespace=True)), {},
     "remove shareProcessNamespace"),
    ("no escalation", _with(lambda p: _main(p).update(
        securityContext={"allowPrivilegeEscalation": False})), {}, "allowPrivilegeEscalation"),
    ("non-root", _with(lambda p: p["spec"].update(securityContext={"runAsNonRoot": True})), {},
     "runAsNonRoot"),
    ("non-root uid", _with(lambda p: p["spec"].update(securityContext={"runAsUser": 1000})), {},
     "runs as uid 1000"),
    ("dropped SYS_ADMIN", _with(lambda p: _main(p).update(
        securityContext={"capabilities": {"drop": ["SYS_ADMIN"]}})), {}, r"drops \['SYS_ADMIN'\]"),
    ("a deployment", _with(lambda p: p.update(kind="Deployment")), {}, "not a Deployment"),
    ("port taken", _with(lambda p: _main(p).update(ports=[{"containerPort": 9464}])), {},
     "already uses port 9464"),
    ("bad quantity", _pod(), {"state_bytes": "6 gigs"}, "not a Kubernetes quantity"),
    ("bad interval", _pod(), {"every": "often"}, "bad duration 'often'"),
    ("negative cost", _pod(), {"final_snapshot_s": -1}, "final_snapshot_s=-1"),
]


@pytest.mark.parametrize("pod,changes,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error(pod: dict[str, Any], changes: dict[str, Any],
                                      message: str) -> None:
    options = {**_options("process", False), **changes}
    with pytest.raises(ConfigError, match=message):
        with_snapshot_sidecar(pod, **options)


def test_state_mode_refuses_a_conflicting_environment() -> None:
    pod = _pod()
    _main(pod)["env"].append({"name": "CAIRN_KEY", "value": "other/key"})
    with pytest.raises(ConfigError, match="already sets CAIRN_KEY"):
        with_snapshot_sidecar(pod, **_options("state", False))


def test_a_transformed_pod_is_not_transformed_again() -> None:
    once = with_snapshot_sidecar(_pod(), **_options("process", False))
    with pytest.raises(ConfigError, match="transformed already"):
        with_snapshot_sidecar(once, **_options("process", False))


def test_not_a_pod() -> None:
    with pytest.raises(ConfigError, match="takes a Pod"):
        with_snapshot_sidecar(["a"], **_options("state", False))
    assert PodMode("process") is PodMode.PROCESS


@pytest.mark.parametrize("text,expected", [("16Gi", 16 * GiB), ("500M", 500_000_000),
                                           ("1e9", 10**9), ("129e6", 129_000_000),
                                           ("0.5Gi", GiB // 2), (1024, 1024), ("1500m", 2)])
def test_quantities(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_quantity_formatting_round_trips() -> None:
    for n in (16 * GiB, 22 * GiB + 3 * MiB, 1000, 8 * 2**40):
        assert parse_bytes(format_bytes(n)) == n
    assert format_bytes(16 * GiB) == "16Gi"
