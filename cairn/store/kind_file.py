"""The ``file`` kind: a directory on a filesystem this host mounts (a bare path or
``file:///PATH``), served by :class:`cairn.store.local.LocalBackend`."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from cairn.exceptions import ConfigError
from cairn.store.kind import StoreKind

_FORMS = "a directory (/data/cairn or file:///data/cairn)"


def path_of(url: str) -> str:
    """The directory ``url`` names. Raises :class:`ConfigError` for a malformed one."""
    url = url.strip()
    if "://" not in url:
        return url
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(f"file URL {url!r} names host {parts.netloc!r}; give {_FORMS}")
    if not parts.path:
        raise ConfigError(f"file URL {url!r} has no path; give {_FORMS}")
    return unquote(parts.path)


def canonical(url: str) -> str:
    """``file://`` and the absolute path, as :class:`~cairn.store.local.LocalBackend` names it."""
    return "file://" + os.path.abspath(path_of(url))


KIND = StoreKind(
    scheme="file",
    title="a local directory",
    url_form=_FORMS,
    remote=False,
    opener="cairn.store.local:open_url",
    validate=path_of,
    canonical=canonical,
    path_of=path_of,
)
