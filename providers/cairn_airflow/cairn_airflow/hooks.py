"""The ``cairn`` connection type: which store a task's snapshots go to.

A connection (``cairn_default`` unless a task names another) gives the store URL in its
``host`` or in the extra ``store_url`` (a directory, or a bucket in any form an installed
store kind accepts: :func:`cairn.store.url_forms`), and optionally the fields that store's kind
declares (``gcs_keyfile_path`` for GCS, a service-account key file on the worker). An encrypted
store (docs/encryption.md) takes its secret from the extra ``secret`` (the text of a secret
file: ``cairn secret new PATH``; Airflow keeps extras encrypted and masks a field of that name
in logs) or ``secret_file_path`` (a secret file on the worker). Only those extras are read; any
other extra is ignored with a warning.

With no ``cairn_default`` connection at all, the store is a local directory,
``$AIRFLOW_HOME/cairn-store`` (``~/airflow/cairn-store`` when ``AIRFLOW_HOME`` is unset): right
for one machine and ``dag.test()``; a cluster whose workers do not share a disk needs a
connection naming a shared store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from airflow.sdk import BaseHook

from cairn.exceptions import ConfigError
from cairn.runtime.env import SECRET_FILE

DEFAULT_CONN_ID = "cairn_default"
#: The extras every connection may have; each store kind adds its own connection fields.
COMMON_EXTRAS = frozenset({"store_url", "secret", "secret_file_path"})

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    """Where snapshots go. ``env``: variables the task process and its children need for the
    store (its kind's connection fields, the secret file); ``source``: where the URL came from."""

    url: str
    env: Mapping[str, str] = field(default_factory=dict)
    source: str = ""


def default_store_url() -> str:
    """The store used when no ``cairn_default`` connection exists."""
    home = os.environ.get("AIRFLOW_HOME") or os.path.join("~", "airflow")
    return os.path.join(os.path.abspath(os.path.expanduser(home)), "cairn-store")


def _extra(extras: Mapping[str, Any], name: str) -> str | None:
    # The connection form may store a declared field as extra__cairn__NAME.
    value = extras.get(name, extras.get(f"extra__cairn__{name}"))
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"cairn connection extra {name!r} must be text, got {value!r}")
    return value.strip() or None


def store_config_from_connection(conn: Any) -> StoreConfig:
    """The store a ``cairn`` connection names. Raises ConfigError when it names none, or two."""
    from cairn.store import store_kind, store_kinds, url_forms

    extras: Mapping[str, Any] = conn.extra_dejson or {}
    fields = {f.extra: (kind, f) for kind in store_kinds() for f in kind.connection_fields}
    allowed = COMMON_EXTRAS | set(fields)
    ignored = sorted(k for k in extras if k.removeprefix("extra__cairn__") not in allowed)
    if ignored:
        log.warning("connection %r: ignoring extras %s (cairn reads only %s)", conn.conn_id,
                    ignored, sorted(allowed))
    from_extra = _extra(extras, "store_url")
    from_host = (conn.host or "").strip() or None
    if from_extra and from_host and from_extra != from_host:
        raise ConfigError(f"connection {conn.conn_id!r} names two stores (host {from_host!r}, "
                          f"extra store_url {from_extra!r}); keep one")
    url = from_extra or from_host
    if not url:
        raise ConfigError(f"connection {conn.conn_id!r} names no store: set its host or the "
                          f"extra store_url to {url_forms()}")
    env = {}
    for name, (kind, connection_field) in fields.items():
        value = _extra(extras, name)
        if value:
            if store_kind(url) != kind:
                raise ConfigError(f"connection {conn.conn_id!r}: {name} is set but the store "
                                  f"{url!r} is not on {kind.title}")
            env[connection_field.env] = value
    secret, secret_path = _extra(extras, "secret"), _extra(extras, "secret_file_path")
    if secret and secret_path:
        raise ConfigError(f"connection {conn.conn_id!r} gives the secret twice (extras secret "
                          "and secret_file_path); keep one")
    if secret_path:
        env[SECRET_FILE.name] = secret_path
    elif secret:
        env[SECRET_FILE.name] = private_secret_file(secret, conn_id=conn.conn_id)
    return StoreConfig(url=url, env=env, source=f"connection {conn.conn_id!r}")


def private_secret_file(text: str, *, conn_id: str) -> str:
    """A file holding the connection's secret, readable by this user only, for the task and
    what it starts (``cairn run``, the Checkpointer's writer process), which find it by
    ``CAIRN_SECRET_FILE``. In memory (``/dev/shm``) where there is one; the same secret maps to
    the same file, which stays for the worker's later tasks."""
    import tempfile

    import blake3

    from cairn.store import secret_from_text

    secret_from_text(text, source=f"connection {conn_id!r}'s extra secret")  # say what is wrong
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()
    directory = os.path.join(base, f"cairn-secrets-{os.getuid()}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or not os.path.isdir(directory) \
            or os.path.islink(directory):
        raise ConfigError(f"{directory} is not a private directory of this user; remove it")
    path = os.path.join(directory, blake3.blake3(text.encode()).hexdigest()[:32] + ".secret")
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(partial, path)
    return path


@contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` inside the block, the previous values back afterwards
    (the process's environment: one task per process, no other thread may rely on it)."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def operator_store_config(*, store_url: str | None, cairn_conn_id: str) -> StoreConfig:
    """The store an operator uses: its own ``store_url`` when given, else the connection."""
    if store_url:
        return StoreConfig(url=store_url, source="the operator's store_url")
    return CairnHook(cairn_conn_id=cairn_conn_id).store_config()


class SerializesCairnConnection:
    """Operator mixin: Airflow serializes ``cairn_conn_id`` with the DAG, so that the snapshots
    page (which reads the serialized DAG) opens the connection the task itself uses."""

    @classmethod
    def get_serialized_fields(cls) -> frozenset[str]:
        return frozenset(super().get_serialized_fields() | {"cairn_conn_id"})  # type: ignore[misc]


class CairnHook(BaseHook):
    """Resolves a ``cairn`` connection into a :class:`StoreConfig`.

    ``CairnHook().store_config()`` reads ``cairn_default``; when that connection does not exist
    it falls back to :func:`default_store_url`. A connection id given explicitly must exist.
    """

    conn_name_attr = "cairn_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "cairn"
    hook_name = "cairn store"

    def __init__(self, cairn_conn_id: str = DEFAULT_CONN_ID, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cairn_conn_id = cairn_conn_id

    def get_conn(self) -> StoreConfig:
        return self.store_config()

    def store_config(self) -> StoreConfig:
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = self.get_connection(self.cairn_conn_id)
        except AirflowNotFoundException:
            if self.cairn_conn_id != DEFAULT_CONN_ID:
                raise
            url = default_store_url()
            self.log.info("no %r connection: using the local store %s", DEFAULT_CONN_ID, url)
            return StoreConfig(url=url, source="default (no cairn_default connection)")
        return store_config_from_connection(conn)

    def test_connection(self) -> tuple[bool, str]:
        """Open the store read-only (it must already exist); the UI's "Test" button."""
        from cairn.exceptions import CairnError
        from cairn import open_store

        try:
            config = self.store_config()
            with scoped_environ(config.env), open_store(config.url, create=False):
                pass
        except (CairnError, OSError) as e:
            return False, str(e)
        return True, f"cairn store {config.url} is reachable"
