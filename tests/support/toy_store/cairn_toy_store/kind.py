"""The toy store's kind: what cairn learns of it through the ``cairn.stores`` entry point.

Cheap to import (cairn reads it to resolve a URL); the backend is in :mod:`.backend`."""

from __future__ import annotations

from urllib.parse import urlsplit

from cairn.exceptions import ConfigError
from cairn.store import ConnectionField, Setting, StoreKind

FORM = "toy://BUCKET/PREFIX"
ROOT_ENV = "CAIRN_TOY_STORE_ROOT"
TOKEN_ENV = "CAIRN_TOY_STORE_TOKEN_FILE"


def bucket_and_prefix(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    if parts.scheme != "toy" or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError(f"toy store URL {url!r} is malformed; give {FORM}")
    return parts.netloc, parts.path.strip("/")


KIND = StoreKind(
    scheme="toy",
    title="the toy store",
    url_form=FORM,
    remote=True,
    opener="cairn_toy_store.backend:open_url",
    install_hint="pip install ./tests/support/toy_store",
    validate=bucket_and_prefix,
    environment=(
        Setting(name=ROOT_ENV),
        Setting(name=TOKEN_ENV, is_file=True, fix="mount the toy token from a Secret volume"),
    ),
    connection_fields=(
        ConnectionField(extra="toy_root", env=ROOT_ENV, label="Toy store root",
                        description="The directory that holds the toy store's buckets"),
    ),
    node_selector=(("toy.example/store-reachable", "true"),),
)
