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
from dataclasses import replace

from cairn.exceptions import ConfigError, StoreUnreachable
from cairn.runtime.durations import parse_duration
from cairn.runtime.env import SECRET_FILE, STORE_CONNECT_TIMEOUT, STORE_TRANSFERS
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


def with_transfers(settings: StoreSettings,
                   environ: Mapping[str, str] | None = None) -> StoreSettings:
    """``settings`` with :data:`STORE_TRANSFERS` in place of the transfer counts it leaves to
    the store's kind (those it sets stay; no more than the ``io_threads`` it sets)."""
    text = (STORE_TRANSFERS.get(environ) or "").strip()
    if not text:
        return settings
    if not text.isdigit() or not 1 <= int(text) <= 256:
        raise ConfigError(f"{STORE_TRANSFERS}={text!r}: give a number of transfers from 1 to 256")
    n = int(text) if settings.io_threads is None else min(int(text), settings.io_threads)
    given = {name: getattr(settings, name) for name in
             ("max_inflight_packs", "read_prefetch", "io_threads")}
    chosen = {name: n if value is None else value for name, value in given.items()}
    chosen["io_threads"] = settings.io_threads or max(chosen.values())
    return replace(settings, **chosen)


def open_store(url: str, *, settings: StoreSettings | None = None, create: bool = True,
               secret: Secret | None = None, environ: Mapping[str, str] | None = None) -> Store:
    """Open the store at ``url`` with ``secret``, else the configured one, and the configured
    first-contact bound (see the module docstring; :meth:`cairn.store.Store.open` says what
    a secret does). cairn's one ``open_store``, also ``cairn.open_store``."""
    secret = secret if secret is not None else configured_secret(environ)
    timeout = connect_timeout(environ)
    settings = with_transfers(settings or StoreSettings(), environ)
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
