"""What a backend tells cairn about its stores: the :class:`StoreKind` contract, version
:data:`API_VERSION`.

A kind is everything cairn needs to know of a backend without opening a store: the URL's
scheme and form, whether the store is a remote bucket, the environment its client reads (a
Kubernetes sidecar that uploads for the workload gets the same), its Airflow connection fields,
and where its :class:`~cairn.store.backend.Backend` is (imported only when a store is opened,
so that a kind's module stays cheap to import). Code above the store layer asks a store's kind
these questions; it never tests a URL's scheme. The registry is :mod:`cairn.store.kinds`.

Contract version history (a distribution's kind says which it implements):

1. (cairn 0.1) The fields of :class:`StoreKind`; the backend contract of
   :mod:`cairn.store.backend`; the opener ``(url, *, create, connect_timeout) -> Backend``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from cairn.exceptions import ConfigError
from cairn.store.backend import Backend

#: The version of this contract. A kind built for another version is refused by name.
API_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Setting:
    """An environment variable a store's client reads.

    ``is_file``: its value names a file (a key), which a sidecar can read only from a volume
    the workload's container mounts; ``fix`` says what to do when it is not on one."""

    name: str
    is_file: bool = False
    fix: str = "mount it from a Secret volume"


@dataclass(frozen=True, kw_only=True)
class ConnectionField:
    """A field of Airflow's ``cairn`` connection (an extra) that sets ``env`` for the task."""

    extra: str
    env: str
    label: str
    description: str


def _no_check(url: str) -> None:
    del url


def _no_path(url: str) -> None:
    del url


def _stripped(url: str) -> str:
    return url.strip()


@dataclass(frozen=True, kw_only=True)
class StoreKind:
    """One kind of store (see the module docstring).

    ``scheme``: the URL scheme (``gs`` for ``gs://...``); ``title``: its name in messages;
    ``url_form``: the URL's form in messages (``gs://BUCKET/PREFIX``).
    ``remote``: the store is a bucket reached over the network, the same from every node, and
    written by whoever holds its credentials: a try may move to another node and still find
    its snapshots; ``cairn run`` as root refuses to restore from it unencrypted (ADR 0025); a
    Kubernetes sidecar needs no volume for it. Not remote: a directory on a filesystem the
    host mounts (``path_of`` gives it).
    ``opener``: ``"module:function"``, called as ``function(url, *, create, connect_timeout)``
    and returning the :class:`~cairn.store.backend.Backend`; ``install_hint``: what to install
    when its module cannot be imported.
    ``validate``: raises :class:`~cairn.exceptions.ConfigError` for a malformed URL of this
    kind, without any I/O (what it returns is ignored: a URL parser serves). ``path_of``: the directory a non-remote store's URL names.
    ``canonical``: the URL as the opened backend's ``url`` names the store, without any I/O
    (records kept outside the store are filed under it; the URL itself when not given).
    ``environment``: what the client reads from the environment. ``connection_fields``: the
    Airflow connection's extras for this kind. ``node_selector``: node labels a Kubernetes
    pod that reaches the store without a key file needs (GKE's Workload Identity metadata
    server for ``gs``), as ``(label, value)`` pairs.
    """

    scheme: str
    title: str
    url_form: str
    remote: bool
    opener: str
    install_hint: str = ""
    validate: Callable[[str], object] = _no_check
    path_of: Callable[[str], str | None] = _no_path
    canonical: Callable[[str], str] = _stripped
    environment: tuple[Setting, ...] = ()
    connection_fields: tuple[ConnectionField, ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    api_version: int = API_VERSION
    source: str = field(default="cairn", compare=False)

    def open(self, url: str, *, create: bool = True,
             connect_timeout: float | None = None) -> Backend:
        """The backend of the store at ``url`` (checked by ``validate`` first)."""
        self.validate(url)
        module_name, _, attribute = self.opener.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            hint = f": {self.install_hint}" if self.install_hint else ""
            raise ConfigError(f"{url!r} needs {self.title}'s client{hint} ({e})") from e
        return getattr(module, attribute)(url, create=create, connect_timeout=connect_timeout)
