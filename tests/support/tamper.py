"""Damage stored objects behind the store's back, on each backend (for corruption tests)."""

from __future__ import annotations

import os

from cairn.store.backend import Backend
from cairn.store.local import LocalBackend


def raw(backend: Backend) -> Backend:
    """The backend under an encrypted store's sealing view: the bytes as stored."""
    return getattr(backend, "inner", backend)


def overwrite(backend: Backend, name: str, data: bytes) -> None:
    """Replace object ``name`` with ``data`` unconditionally (what bit rot or a bad disk does);
    ``data`` is stored as given, never sealed."""
    backend = raw(backend)
    if isinstance(backend, LocalBackend) or backend.url.startswith("toy://"):
        path = os.path.join(backend.root, name) if isinstance(backend, LocalBackend) else \
            backend._file(name)  # the toy store (tests/support/toy_store): one file an object
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write(data)
        return
    if backend.url.startswith("s3://"):
        backend._client.put_object(Bucket=backend.bucket, Key=backend._key(name), Body=data)
        return
    from google.cloud import storage

    bucket_name, _, prefix = backend.url[len("gs://"):].partition("/")
    client = storage.Client(project="cairn-test")
    full = f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name
    client.bucket(bucket_name).blob(full).upload_from_string(data)


def overwrite_record(store, name: str, data: bytes) -> None:  # noqa: ANN001 - a Store
    """Replace record ``name`` with ``data`` as a writer holding the store's secret could:
    sealed when the store is encrypted (anyone else's rewrite fails authentication)."""
    if store.sealer is not None:
        data = store.sealer.seal_object(name, data)
    overwrite(store.backend, name, data)


def flip_byte(backend: Backend, name: str, offset: int) -> None:
    data = bytearray(raw(backend).read(name))
    data[offset] ^= 0xFF
    overwrite(backend, name, bytes(data))


def truncate(backend: Backend, name: str, length: int) -> None:
    overwrite(backend, name, raw(backend).read(name)[:length])
