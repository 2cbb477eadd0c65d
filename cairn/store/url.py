"""Choose a backend from a store URL: a path or ``file://`` → local, ``gs://`` → GCS."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from cairn.exceptions import ConfigError
from cairn.store.backend import Backend

_HELP = "give a local directory (/data/cairn or file:///data/cairn) or a bucket (gs://BUCKET/PREFIX)"


def open_backend(url: str, *, create: bool = True, connect_timeout: float | None = None) -> Backend:
    """The backend for ``url``. Raises :class:`ConfigError` naming the accepted forms.

    ``connect_timeout``: how long a bucket's first contact may take, retries included
    (default :data:`cairn.store.gcs.DEFAULT_CONNECT_TIMEOUT`); a local directory has none."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"empty store URL; {_HELP}")
    url = url.strip()
    if "://" not in url:
        if ":" in url.split("/", 1)[0] and not os.path.exists(url):
            raise ConfigError(f"cannot parse store URL {url!r}; {_HELP}")
        from cairn.store.local import LocalBackend

        return LocalBackend(url, create=create)
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL {url!r} names host {parts.netloc!r}; {_HELP}")
        if not parts.path:
            raise ConfigError(f"file URL {url!r} has no path; {_HELP}")
        from cairn.store.local import LocalBackend

        return LocalBackend(unquote(parts.path), create=create)
    if parts.scheme == "gs":
        if not parts.netloc:
            raise ConfigError(f"GCS URL {url!r} has no bucket; {_HELP}")
        if parts.query or parts.fragment:
            raise ConfigError(f"GCS URL {url!r} has a query or fragment; {_HELP}")
        try:
            from cairn.store.gcs import GCSBackend
        except ImportError as e:  # pragma: no cover - depends on the installed extras
            raise ConfigError(
                f"{url!r} needs the GCS client: pip install 'cairn-resume[gcs]' ({e})"
            ) from e
        if connect_timeout is None:
            return GCSBackend(parts.netloc, parts.path.strip("/"))
        return GCSBackend(parts.netloc, parts.path.strip("/"), connect_timeout=connect_timeout)
    raise ConfigError(f"unsupported store URL scheme {parts.scheme!r} in {url!r}; {_HELP}")
