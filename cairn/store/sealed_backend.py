"""An encrypted store's view of its backend: every object sealed whole, except packs.

Packs hold chunk extents sealed one by one by their writer (:mod:`cairn.store.packs`) and are
read by range (:mod:`cairn.store.reader`), so they pass through raw; so do the store's config
(which holds no secret) and the keyring records (sealed by the secret itself). Every other
name — slot-log records, outcome records, requests, parts, an integration's objects — is
sealed on ``create`` and opened on ``read``; an object that is not sealed, or fails, raises
:class:`~cairn.store.sealing.SealBroken` (a :class:`~cairn.exceptions.CorruptSnapshot`).
Listings and sizes are the backend's own: a bucket reader sees names and sizes only.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator

from cairn.store.backend import Backend, BlobWriter, ObjectInfo
from cairn.store.keyring import KEYRING_PREFIX
from cairn.store.packs import PACKS_PREFIX
from cairn.store.sealing import Sealer


class SealedBackend(Backend):
    """``inner`` with whole-object sealing (see the module docstring). Thread-safe as the
    inner backend is."""

    def __init__(self, inner: Backend, sealer: Sealer, *, raw_names: frozenset[str]) -> None:
        self.inner = inner
        self.sealer = sealer
        self.url = inner.url
        self.guarded_deletes = inner.guarded_deletes
        self.version_resolution_seconds = inner.version_resolution_seconds
        self._raw_names = raw_names
        # The last sealed object read by range, opened once for all its ranges: (name,
        # version) -> plaintext.
        self._ranged: tuple[tuple[str, str], bytes] | None = None
        self._lock = threading.Lock()

    def _raw(self, name: str) -> bool:
        return (name.startswith(PACKS_PREFIX) or name.startswith(KEYRING_PREFIX)
                or name in self._raw_names)

    def create(self, name: str, data: bytes) -> None:
        self.inner.create(name, data if self._raw(name) else self.sealer.seal_object(name, data))

    def open_writer(self, name: str) -> BlobWriter:
        if self._raw(name):
            return self.inner.open_writer(name)
        return _SealingWriter(self, name)

    def read(self, name: str) -> bytes:
        data = self.inner.read(name)
        return data if self._raw(name) else self.sealer.open_object(name, data)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if self._raw(name):
            return self.inner.read_range(name, offset, length)
        # A sealed object authenticates as a whole: open it once, then serve its ranges (an
        # integration reading an output block by block) from memory while it is unchanged.
        ident = (name, self.inner.stat(name).version)
        with self._lock:
            cached = self._ranged
        if cached is None or cached[0] != ident:
            cached = (ident, self.read(name))
            with self._lock:
                self._ranged = cached
        return cached[1][offset:offset + length]

    def read_range_into(self, name: str, offset: int, buffer: memoryview) -> int:
        if self._raw(name):
            return self.inner.read_range_into(name, offset, buffer)
        return super().read_range_into(name, offset, buffer)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, name: str) -> ObjectInfo:
        return self.inner.stat(name)

    def delete(self, name: str, *, if_version: str | None = None) -> None:
        self.inner.delete(name, if_version=if_version)

    def touch(self, name: str) -> None:
        self.inner.touch(name)

    def close(self) -> None:
        self.inner.close()


class _SealingWriter(BlobWriter):
    """A streamed object sealed whole on commit (held in memory until then)."""

    def __init__(self, backend: SealedBackend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._buffer: io.BytesIO | None = io.BytesIO()

    def write(self, data: bytes | memoryview) -> None:
        if self._buffer is None:
            raise ValueError("write after commit or abort")
        self._buffer.write(data)

    def commit(self) -> None:
        if self._buffer is None:
            raise ValueError("commit after commit or abort")
        data, self._buffer = self._buffer.getvalue(), None
        self._backend.create(self._name, data)

    def abort(self) -> None:
        self._buffer = None
