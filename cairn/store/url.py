"""Open a backend from a store URL, through the store kind its scheme names
(:mod:`cairn.store.kinds`)."""

from __future__ import annotations

from cairn.store.backend import Backend
from cairn.store.kinds import store_kind


def open_backend(url: str, *, create: bool = True, connect_timeout: float | None = None) -> Backend:
    """The backend for ``url``. Raises :class:`~cairn.exceptions.ConfigError` naming the
    accepted forms.

    ``connect_timeout``: how long a remote store's first contact may take, retries included
    (the backend's default when None); a local directory has none."""
    return store_kind(url).open(url.strip(), create=create, connect_timeout=connect_timeout)


def canonical_url(url: str) -> str:
    """``url`` as the store's backend will name it once opened (``Backend.url``), without any
    I/O. Raises :class:`~cairn.exceptions.ConfigError` for a malformed one."""
    kind = store_kind(url)
    kind.validate(url)
    return kind.canonical(url)
