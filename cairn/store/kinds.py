"""The registry of store kinds: which :class:`~cairn.store.kind.StoreKind` a store URL names.

A bare path and ``file://`` are the ``file`` kind, ``gs://`` the ``gs`` kind, ``s3://`` the
``s3`` kind; any other scheme
is looked up among the entry points of the group :data:`ENTRY_POINT_GROUP` (``cairn.stores``)
that installed distributions declare, the way fsspec finds its implementations::

    [project.entry-points."cairn.stores"]
    azure = "my_package.cairn_kind:KIND"     # the name is the scheme; the object a StoreKind

The entry points are read only for a scheme cairn does not know, or to list every kind (about
20-35 ms here), and then once per process. A distribution's kind must implement this cairn's
contract version (:data:`~cairn.store.kind.API_VERSION`) and may not take a built-in scheme;
either is refused with a message that names the distribution.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace

from cairn.exceptions import ConfigError
from cairn.store import kind_file, kind_gcs, kind_s3
from cairn.store.kind import API_VERSION, StoreKind

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cairn.stores"
BUILTIN: tuple[StoreKind, ...] = (kind_file.KIND, kind_gcs.KIND, kind_s3.KIND)
_BUILTIN_BY_SCHEME = {k.scheme: k for k in BUILTIN}


def scheme_of(url: str) -> str:
    """The scheme of a store URL; ``file`` for a bare path."""
    url = url.strip()
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def store_kind(url: str) -> StoreKind:
    """The kind of the store at ``url``, after its ``validate``. Raises :class:`ConfigError`
    naming the accepted forms for an empty URL, an unknown scheme or a malformed URL."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"empty store URL; give {url_forms()}")
    scheme = scheme_of(url)
    head = url.strip().split("/", 1)[0]
    if scheme == "file" and "://" not in url and ":" in head and not os.path.exists(url.strip()):
        raise ConfigError(f"cannot parse store URL {url!r}; give {url_forms()}")
    kind = _BUILTIN_BY_SCHEME.get(scheme) or _installed()[0].get(scheme)
    if kind is None and scheme in _installed()[1]:
        raise ConfigError(f"store URL {url!r}: {_installed()[1][scheme]}")
    if kind is None:
        raise ConfigError(f"unsupported store URL scheme {scheme!r} in {url!r}; give "
                          f"{url_forms()} (a distribution may add a scheme: see "
                          f"docs/store-backends.md)")
    kind.validate(url.strip())
    return kind


def store_kinds() -> tuple[StoreKind, ...]:
    """Every kind: the built-in ones, then the installed distributions' by scheme."""
    installed = _installed()[0]
    return BUILTIN + tuple(installed[s] for s in sorted(installed))


def url_forms(*, remote: bool | None = None) -> str:
    """The accepted URL forms for messages (``remote``: only those kinds, or only the others)."""
    forms = [k.url_form for k in store_kinds() if remote is None or k.remote is remote]
    return forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]


@functools.cache
def _installed() -> tuple[dict[str, StoreKind], dict[str, str]]:
    """The installed distributions' kinds by scheme, and why each refused one was refused."""
    from importlib.metadata import entry_points

    found: dict[str, StoreKind] = {}
    refused: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "an unnamed distribution"
        where = f"entry point {ep.name!r} = {ep.value!r} of {dist}"
        if ep.name in _BUILTIN_BY_SCHEME:
            log.warning("cairn: ignoring %s: the scheme %r is cairn's own", where, ep.name)
            continue
        try:
            kind = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not break other stores
            refused[ep.name] = f"{where} cannot be loaded ({type(e).__name__}: {e}); fix or " \
                               f"uninstall {dist}"
            continue
        if not isinstance(kind, StoreKind) or kind.scheme != ep.name:
            refused[ep.name] = f"{where} is not a cairn.store.StoreKind for the scheme " \
                               f"{ep.name!r}; fix or uninstall {dist}"
        elif kind.api_version != API_VERSION:
            refused[ep.name] = f"{where} implements store contract version " \
                               f"{kind.api_version}, this cairn version {API_VERSION}; install " \
                               f"a version of {dist} made for this cairn, or upgrade cairn"
        elif ep.name in found:
            refused[ep.name] = f"two installed distributions claim the scheme {ep.name!r} " \
                               f"({found.pop(ep.name).source} and {dist}); uninstall one"
        elif ep.name not in refused:
            found[ep.name] = replace(kind, source=dist)
    return found, refused
