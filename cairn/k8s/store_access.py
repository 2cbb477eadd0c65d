"""What the uploading sidecar needs to reach a pod's store: the environment the store's kind
declares (credentials settings, the secret file) and the volumes the files it names are on, or,
for a store on a mounted filesystem, that volume (:mod:`cairn.store.kinds`)."""

from __future__ import annotations

import warnings
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime import env
from cairn.store import Setting, store_kind, url_forms


class StoreAccessWarning(UserWarning):
    """The uploading sidecar cannot reach the store the way the main container can."""


_SECRET_SETTING = Setting(name=env.SECRET_FILE.name, is_file=True,
                          fix="mount it from a Secret volume, or pass secret_name= to mount one")


def store_env(store: str) -> tuple[Setting, ...]:
    """What the client of the store at ``store`` reads from the environment (its kind's
    settings and the secret file): the uploading sidecar gets the main container's values."""
    return store_kind(store).environment + (_SECRET_SETTING,)


def _mount_for(container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The container's volume mount that holds ``path`` (the deepest one)."""
    best = None
    for m in container.get("volumeMounts") or []:
        root = str(m.get("mountPath", "")).rstrip("/")
        if path == root or path.startswith(root + "/"):
            if best is None or len(root) > len(str(best["mountPath"]).rstrip("/")):
                best = m
    return best


def uploader_access(main: dict[str, Any], sidecar: dict[str, Any], store: str) -> None:
    """Give the uploading sidecar what the main container uses to reach the store: the
    credentials settings in its environment (and the volume a key file is on), or for a store
    on a mounted volume, that volume at the same path."""
    settings = {s.name: s for s in store_env(store)}
    wanted = [dict(e) for e in main.get("env") or [] if e.get("name") in settings]
    mounts: list[dict[str, Any]] = []
    for e in wanted:
        setting = settings[e["name"]]
        if setting.is_file and isinstance(e.get("value"), str):
            mount = _mount_for(main, e["value"])
            if mount is None:
                raise ConfigError(
                    f"{e['name']}={e['value']} is not on a volume container "
                    f"{main.get('name')!r} mounts, so the uploading sidecar cannot read it: "
                    f"{setting.fix}")
            mounts.append({**mount, "readOnly": True})
    kind = store_kind(store)
    path = kind.path_of(store)
    if not kind.remote and path is not None:
        mount = _mount_for(main, path)
        if mount is None:
            warnings.warn(StoreAccessWarning(
                f"store {store!r} is not on a volume container {main.get('name')!r} mounts: "
                "the uploading sidecar would write it into its own filesystem, which dies with "
                "the pod. Mount a persistent volume there (the sidecar gets it too), or use "
                f"a bucket ({url_forms(remote=True)})"), stacklevel=3)
        else:
            mounts.append(dict(mount))
    if wanted:
        sidecar["env"] = list(sidecar.get("env") or []) + wanted
    taken = {m["mountPath"] for m in sidecar["volumeMounts"]}
    for mount in mounts:
        if mount["mountPath"] not in taken:
            sidecar["volumeMounts"].append(mount)
            taken.add(mount["mountPath"])


def check_store(store: str) -> str:
    if not isinstance(store, str) or not store.strip():
        raise ConfigError(f"store= is empty; give a bucket ({url_forms(remote=True)}) or a "
                          "path on a mounted persistent volume")
    try:
        store_kind(store)
    except ConfigError as e:
        raise ConfigError(f"store= {e}") from None
    return store.strip()
