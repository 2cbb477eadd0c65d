"""A store backend plugged in from outside: the toy store (``toy://``), a test-only distribution
(``tests/support/toy_store``) that ``make test`` installs into each test environment, reaches
cairn only through the ``cairn.stores`` entry point. The store conformance modules run on it
(``CONFORMANCE_MODULES`` in ``tests/conftest.py``); here: that cairn's code does not know it,
that the questions cairn asks of a store (remote? what does its sidecar need?) are answered by
its kind, and that a broken or foreign plug-in is refused by name."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import warnings
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from cairn.exceptions import ConfigError
from cairn.k8s import with_snapshot_sidecar
from cairn.process.supervisor import unauthenticated_root_restore
from cairn.store import API_VERSION, StoreKind, new_secret, store_kind, store_kinds
from cairn import open_store
from cairn.store import kinds as kinds_module
from cairn.store.url import open_backend

ROOT = Path(__file__).resolve().parents[3]
TOKEN_DIR = "/var/run/toy-token"


def test_the_toy_kind_comes_from_its_distributions_entry_point(toy_store_root: str) -> None:
    eps = importlib.metadata.entry_points(group=kinds_module.ENTRY_POINT_GROUP)
    assert [(ep.name, ep.dist.name) for ep in eps if ep.name == "toy"] == [
        ("toy", "cairn-toy-store")]
    kind = store_kind("toy://bucket/a")
    assert kind.source == "cairn-toy-store" and kind.remote
    assert kind.url_form == "toy://BUCKET/PREFIX"
    assert kind in store_kinds()
    backend = open_backend("toy://bucket/a")
    try:
        assert type(backend).__module__ == "cairn_toy_store.backend"
        backend.create("x", b"1")
        assert (Path(toy_store_root) / "bucket").is_dir()
    finally:
        backend.close()
    # cairn's own code never names the toy: it came in through the registry alone.
    found = subprocess.run(["grep", "-rIlw", "toy", "cairn/",
                            "providers/cairn_airflow/cairn_airflow", "kfp_components/cairn_kfp"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 1 and found.stdout == "", found.stdout


def test_a_malformed_toy_url_is_the_toys_own_error() -> None:
    with pytest.raises(ConfigError, match="give toy://BUCKET/PREFIX"):
        store_kind("toy://")
    with pytest.raises(ConfigError, match=r"unsupported store URL scheme 'nope'.*toy://BUCKET"):
        store_kind("nope://x")


def test_root_refuses_an_unencrypted_toy_store_because_it_is_remote(toy_store_root: str) -> None:
    """The refusal asks the kind (``remote``), so a plugged-in bucket gets it too; before the
    registry an ``s3://``-like store would have been let through (only ``gs://`` was tested)."""
    del toy_store_root
    with open_store("toy://bucket/root-plain") as plain:
        why = unauthenticated_root_restore(plain, euid=0, environ={})
        assert why is not None and "toy://bucket/root-plain" in why
        assert unauthenticated_root_restore(plain, euid=1000, environ={}) is None
    with open_store("toy://bucket/root-sealed", secret=new_secret(source="test")) as sealed:
        assert unauthenticated_root_restore(sealed, euid=0, environ={}) is None


def _pod(env: list[dict[str, str]]) -> dict[str, Any]:
    main = {"name": "train", "image": "registry.example/train:1.4",
            "command": ["python", "train.py"], "env": env,
            "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
            "volumeMounts": [{"name": "toy-token", "mountPath": TOKEN_DIR, "readOnly": True}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train-0"},
            "spec": {"restartPolicy": "Never", "containers": [main],
                     "volumes": [{"name": "toy-token", "secret": {"secretName": "toy"}}]}}


def _transform(pod: dict[str, Any]) -> dict[str, Any]:
    return with_snapshot_sidecar(pod, store="toy://bucket/cairn", key="dag/train/run-1",
                                 mode="process", sidecar_image="registry.example/cairn:0.1.0",
                                 state_bytes="1Gi")


def test_the_pod_transform_gives_the_sidecar_what_the_toy_kind_declares() -> None:
    env = [{"name": "CAIRN_TOY_STORE_ROOT", "value": "/toy"},
           {"name": "CAIRN_TOY_STORE_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"},
           {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": "/elsewhere/key.json"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a remote store needs no volume: no StoreAccessWarning
        out = _transform(_pod(env))
    sidecar = out["spec"]["initContainers"][0]
    names = {e["name"]: e.get("value") for e in sidecar.get("env") or []}
    assert names["CAIRN_TOY_STORE_ROOT"] == "/toy"
    assert names["CAIRN_TOY_STORE_TOKEN_FILE"] == f"{TOKEN_DIR}/token"
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in names  # another kind's setting
    assert {"name": "toy-token", "mountPath": TOKEN_DIR, "readOnly": True} in \
        sidecar["volumeMounts"]
    unmounted = [env[0], {"name": "CAIRN_TOY_STORE_TOKEN_FILE", "value": "/nowhere/token"}]
    with pytest.raises(ConfigError, match="mount the toy token from a Secret volume"):
        _transform(_pod(unmounted))


KIND_V2 = StoreKind(scheme="v2", title="a store from the future", url_form="v2://X", remote=True,
                    opener="nowhere:open", api_version=API_VERSION + 1)
NOT_A_KIND = object()
GS_AGAIN = StoreKind(scheme="gs", title="a second GCS", url_form="gs://X", remote=True,
                     opener="nowhere:open")
DUP = StoreKind(scheme="dup", title="one of two", url_form="dup://X", remote=True,
                opener="nowhere:open")


@pytest.fixture()
def entry_points(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Replace the installed entry points with ``EntryPoint`` objects (importlib's own) whose
    targets are this module's objects; the registry's cache is cleared around the test."""

    def install(*pairs: tuple[str, str]) -> None:
        eps = [EntryPoint(name=name, value=f"{__name__}:{target}",
                          group=kinds_module.ENTRY_POINT_GROUP) for name, target in pairs]
        monkeypatch.setattr(importlib.metadata, "entry_points",
                            lambda group=None: [e for e in eps if e.group == group])
        kinds_module._installed.cache_clear()

    yield install
    kinds_module._installed.cache_clear()


def test_plug_ins_that_do_not_fit_are_refused_by_name(entry_points: Any) -> None:
    assert sys.modules[__name__].KIND_V2 is KIND_V2  # what the entry points below load
    entry_points(("v2", "KIND_V2"), ("bad", "NOT_A_KIND"), ("gs", "GS_AGAIN"), ("dup", "DUP"),
                 ("dup", "DUP"), ("broken", "NO_SUCH_NAME"))
    with pytest.raises(ConfigError, match=rf"contract version {API_VERSION + 1}, this cairn "
                                          rf"version {API_VERSION}.*or upgrade cairn"):
        store_kind("v2://x")
    with pytest.raises(ConfigError, match="is not a cairn.store.StoreKind for the scheme 'bad'"):
        store_kind("bad://x")
    with pytest.raises(ConfigError, match="two installed distributions claim the scheme 'dup'"):
        store_kind("dup://x")
    with pytest.raises(ConfigError, match="'broken'.*cannot be loaded.*AttributeError"):
        store_kind("broken://x")
    assert store_kind("gs://bucket/p").title == "Google Cloud Storage"  # cairn's own gs wins
    assert [k.scheme for k in store_kinds()] == ["file", "gs", "s3"]  # none was taken
