"""Issue 15, pod files: over every spec the transform generates, no credential travels in an env
value (a key file comes from a mounted volume, or Workload Identity needs none), and the shared
volume belongs to one group both containers are in (``fsGroup``), so nothing in it needs to be
world-readable."""

from __future__ import annotations

import copy
import itertools
import json
import re
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from cairn.exceptions import ConfigError
from cairn.k8s import with_snapshot_sidecar
from cairn.k8s.store_access import store_env
from cairn.k8s.transform import SIDECAR_UID

IMAGE = "registry.example/cairn-sidecar:0.1.0"
KEY_DIR = "/var/secrets/gcp"
# What credential material looks like in a value: PEM keys, a service-account JSON, bearer or
# query tokens, AWS access key ids, URL user info, long base64 runs.
_CREDENTIAL = re.compile(r"PRIVATE KEY|\"private_key\"|[Bb]earer |[?&](token|sig|key)=|AKIA[0-9A-Z]{16}"
                         r"|://[^/@\s]+:[^/@\s]+@|[A-Za-z0-9+/=]{80,}")
_CREDENTIAL_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|PRIVATE|ACCESS_KEY|API_KEY",
                              re.IGNORECASE)
# Settings whose value is the path of a secret file, which must be on a read-only volume.
#: What the gs:// store every spec here uses reads from the environment.
STORE_SETTINGS = frozenset(s.name for s in store_env("gs://bucket/cairn"))
_FILE_SETTINGS = ("GOOGLE_APPLICATION_CREDENTIALS", "CAIRN_SECRET_FILE")


def _pod(credentials: str, fs_group: int | None) -> dict[str, Any]:
    main: dict[str, Any] = {
        "name": "train", "image": "registry.example/train:1.4",
        "command": ["python", "train.py"],
        "env": [{"name": "EPOCHS", "value": "3"}],
        "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [main],
                            "volumes": [{"name": "data", "emptyDir": {}}]}
    if credentials == "key-file":
        main["env"] += [{"name": "GOOGLE_APPLICATION_CREDENTIALS",
                         "value": f"{KEY_DIR}/key.json"},
                        {"name": "GOOGLE_CLOUD_PROJECT", "value": "proj"}]
        spec["volumes"].append({"name": "gcp-key", "secret": {"secretName": "gcp-key"}})
        main["volumeMounts"].append({"name": "gcp-key", "mountPath": KEY_DIR, "readOnly": True})
    elif credentials == "emulator":
        main["env"].append({"name": "STORAGE_EMULATOR_HOST", "value": "http://gcs.test:4443"})
    if fs_group is not None:
        spec["securityContext"] = {"fsGroup": fs_group}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train-0"}, "spec": spec}


def _every_spec() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, input pod, output pod) for every combination of the transform's options."""
    out = []
    for mode, staging, gpu, watch, avoid, credentials, fs_group, sealed in itertools.product(
            ["process", "state"], ["memory", "disk"], [False, True], [False, True],
            [False, True], ["workload-identity", "key-file", "emulator"], [None, 1234],
            [False, True]):
        pod = _pod(credentials, fs_group)
        if gpu:
            for part in ("requests", "limits"):
                pod["spec"]["containers"][0]["resources"][part]["nvidia.com/gpu"] = "1"
        options: dict[str, Any] = {"store": "gs://bucket/cairn", "key": "dag/train/run-1",
                                   "mode": mode, "sidecar_image": IMAGE, "staging": staging,
                                   "watch_node_label": watch, "avoid_maintenance": avoid}
        if mode == "process":
            options["state_bytes"] = "6Gi"
        if gpu:
            options["gpu_memory_bytes"] = "40Gi"
        if sealed:  # an encrypted store: its secret file from a Kubernetes Secret (ADR 0025)
            options["secret_name"] = "cairn-store-secret"
        label = (f"{mode}-{staging}-{'gpu' if gpu else 'cpu'}-{watch}-{avoid}-{credentials}-"
                 f"{fs_group}{'-sealed' if sealed else ''}")
        out.append((label, pod, with_snapshot_sidecar(copy.deepcopy(pod), **options)))
    return out


SPECS = _every_spec()


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _credential_problems(given: dict[str, Any], out: dict[str, Any]) -> tuple[list[str], int]:
    """What is wrong with the env entries the transform added, and how many it added."""
    given_env = {c["name"]: c.get("env") or [] for c in _containers(given)}
    problems: list[str] = []
    added = 0
    for container in _containers(out):
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts") or []}
        for entry in container.get("env") or []:
            if entry in given_env.get(container["name"], []):
                continue  # the user's own, left as it was
            added += 1
            name, value = entry["name"], entry.get("value")
            if "secretKeyRef" in json.dumps(entry) or (_CREDENTIAL_NAME.search(name)
                                                       and name not in _FILE_SETTINGS):
                problems.append(f"{container['name']}: {name} looks like a secret")
            elif value is None:
                if set(entry.get("valueFrom") or {"?": 1}) - {"fieldRef", "configMapKeyRef"}:
                    problems.append(f"{container['name']}: {name} comes from {entry}")
            elif _CREDENTIAL.search(value):
                problems.append(f"{container['name']}: {name} has credential material")
            elif name in _FILE_SETTINGS:
                # A path, on a volume this container mounts read-only: the key is a file.
                mount = next((m for p, m in mounts.items() if value.startswith(p + "/")), None)
                if name not in STORE_SETTINGS or mount is None or mount.get("readOnly") is not True:
                    problems.append(f"{container['name']}: {value} is not on a read-only mount")
    return problems, added


@pytest.mark.parametrize("label,given,out", SPECS, ids=[s[0] for s in SPECS])
def test_no_generated_env_value_carries_a_credential(label: str, given: dict[str, Any],
                                                     out: dict[str, Any]) -> None:
    problems, added = _credential_problems(given, out)
    assert problems == [], label
    assert added > 0, f"{label}: the transform adds env entries; the check saw none"


def test_the_check_sees_a_planted_credential() -> None:
    _label, given, out = next(s for s in SPECS if "key-file" in s[0] and s[0].startswith("process"))
    planted = copy.deepcopy(out)
    sidecar = planted["spec"]["initContainers"][0]
    sidecar["env"].append({"name": "GCS_KEY", "value": '{"private_key": "-----BEGIN PRIVATE KEY'})
    sidecar["env"].append({"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})
    for m in sidecar["volumeMounts"]:
        m.pop("readOnly", None)
    problems, _ = _credential_problems(given, planted)
    assert len(problems) == 3, problems


@pytest.mark.parametrize("label,given,out", SPECS, ids=[s[0] for s in SPECS])
def test_the_shared_volume_belongs_to_one_group(label: str, given: dict[str, Any],
                                                out: dict[str, Any]) -> None:
    sc = out["spec"]["securityContext"]
    wanted = (given["spec"].get("securityContext") or {}).get("fsGroup", SIDECAR_UID)
    assert sc["fsGroup"] == wanted, label  # a pod's own group is kept: both containers get it
    assert sc["fsGroupChangePolicy"] == "OnRootMismatch", label


@pytest.mark.parametrize("mode", ["process", "state"])
def test_an_encrypted_stores_secret_is_a_mounted_file_every_store_user_reads(mode: str) -> None:
    """``secret_name=``: the Secret is a read-only volume, named by CAIRN_SECRET_FILE in the
    main container and, in process mode, the uploading sidecar; its bytes are nowhere in the
    spec."""
    out = with_snapshot_sidecar(_pod("workload-identity", None), store="gs://bucket/cairn",
                                key="dag/train/run-1", mode=mode, sidecar_image=IMAGE,
                                state_bytes="6Gi", secret_name="cairn-store-secret")
    (volume,) = [v for v in out["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "cairn-store-secret"
    readers = [c for c in _containers(out)
               if any(e["name"] == "CAIRN_SECRET_FILE" for e in c.get("env") or [])]
    assert {c["name"] for c in readers} == ({"train", "cairn-sidecar"} if mode == "process"
                                            else {"train"})
    for container in readers:
        path = next(e["value"] for e in container["env"] if e["name"] == "CAIRN_SECRET_FILE")
        mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
        assert path.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    for version in ("1.29", latest_version()):
        kubernetes_validate.validate(out, version, strict=True)
    with pytest.raises(ConfigError, match="secret_name="):
        with_snapshot_sidecar(_pod("workload-identity", None), store="gs://bucket/cairn",
                              key="k", mode=mode, sidecar_image=IMAGE, state_bytes="6Gi",
                              secret_name="Not A Name")
