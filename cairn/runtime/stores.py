"""Opening a store as the environment configures it: the one place the secret is found.

Every process that opens a store — each `cairn` command, `cairn run` and its uploader, the
Checkpointer and its writer process, the sidecar, the integrations — opens it here, so a
secret set once (:data:`~cairn.runtime.env.SECRET_FILE`, which `cairn --secret-file PATH`
sets for the command and its children) reaches all of them. Wrong or missing secrets are a
:class:`~cairn.store.SecretError` (exit 2) naming that setting, never a fresh start. The
first contact with a bucket is bounded by :data:`~cairn.runtime.env.STORE_CONNECT_TIMEOUT`
(ADR 0032): a store that cannot be reached within it is a
:class:`~cairn.exceptions.StoreUnreachable` (exit 6) naming the store, never a fresh start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cairn.exceptions import StoreUnreachable
from cairn.runtime.durations import parse_duration
from cairn.runtime.env import SECRET_FILE, STORE_CONNECT_TIMEOUT
from cairn.store import Secret, SecretError, Store, StoreSettings, load_secret_file, store_kind


def configured_secret(environ: Mapping[str, str] | None = None) -> Secret | None:
    """The secret the environment names, None when it names none."""
    path = SECRET_FILE.get(environ)
    if not path:
        return None
    try:
        return load_secret_file(os.path.expanduser(path))
    except SecretError as e:
        raise SecretError(f"{SECRET_FILE}: {e}") from None


def connect_timeout(environ: Mapping[str, str] | None = None) -> float:
    """The first contact's bound in seconds, from :data:`STORE_CONNECT_TIMEOUT`."""
    return parse_duration(STORE_CONNECT_TIMEOUT.get(environ) or "",
                          name=STORE_CONNECT_TIMEOUT.name)


def open_store(url: str, *, settings: StoreSettings | None = None, create: bool = True,
               secret: Secret | None = None, environ: Mapping[str, str] | None = None) -> Store:
    """Open the store at ``url`` with ``secret``, else the configured one, and the configured
    first-contact bound (see the module docstring; :meth:`cairn.store.Store.open` says what
    a secret does). cairn's one ``open_store``, also ``cairn.open_store``."""
    secret = secret if secret is not None else configured_secret(environ)
    timeout = connect_timeout(environ)
    try:
        return Store.open(url, settings=settings, create=create, secret=secret,
                          connect_timeout=timeout)
    except StoreUnreachable as e:
        if not store_kind(url).remote:
            raise
        raise StoreUnreachable(f"{e} ({STORE_CONNECT_TIMEOUT}={timeout:g}s bounds the wait)",
                               url=e.url, reason=e.reason) from e.__cause__
    except SecretError as e:
        if secret is None:
            raise SecretError(f"{e}. Set {SECRET_FILE} to the store's secret file (or run "
                              "`cairn --secret-file PATH ...`)") from None
        raise SecretError(f"{e} (set by {SECRET_FILE}={SECRET_FILE.get(environ)})") from None
