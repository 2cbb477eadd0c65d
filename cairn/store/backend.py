"""The one small interface every storage backend implements.

A backend stores named, immutable objects. It knows nothing of keys, snapshots or chunks; the
store builds those on top. Names are ``/``-separated relative paths made only of the characters
:mod:`cairn.store.keys` produces, so every backend can map them directly.

Contracts every backend meets (``tests/conformance`` checks each one):

* :meth:`Backend.create` and :meth:`BlobWriter.commit` are **create-only** and **durable on
  return**: the name did not exist and now holds exactly the bytes given, or
  :class:`~cairn.exceptions.AlreadyExists` is raised and nothing changed.
* :meth:`Backend.touch` changes the object's ``version`` and ``updated``; so does re-creation
  after a delete. :meth:`Backend.delete` with ``if_version`` deletes only that exact version.
* :meth:`Backend.list` returns every object whose name starts with ``prefix``, sorted by name.
* All methods may be called from several threads at once.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cairn.exceptions import ConfigError, StoreError


#: Names a backend may create and delete for its own checks (a probe of the endpoint); they
#: are not store content, and a store that holds only these counts as empty.
SCRATCH_PREFIX = "tmp/"


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says of one object.

    ``version`` is an opaque token that changes whenever the object is re-created or touched;
    ``updated`` is the time (seconds since the epoch) of its creation or last touch.
    """

    name: str
    size: int
    version: str
    updated: float


class BlobWriter(abc.ABC):
    """A streaming create-only upload. Use as a context manager; nothing is visible before
    :meth:`commit`, and leaving the block without committing discards what was written."""

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``; the caller may reuse its memory as soon as this returns."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Publish the object create-only and durably (see the module contract)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written. Safe to call more than once or after commit."""

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class BufferedWriter(BlobWriter):
    """A :class:`BlobWriter` that buffers in memory and hands the whole object to ``publish``
    (a backend's create-only upload) on commit: nothing is visible before. For backends whose
    objects are created in one request or a few."""

    def __init__(self, name: str, publish: Callable[[bytearray], None]) -> None:
        self._name = name
        self._publish = publish
        self._buffer: bytearray | None = bytearray()

    def write(self, data: bytes | memoryview) -> None:
        if self._buffer is None:
            raise StoreError(f"write to {self._name} after commit or abort")
        self._buffer += data

    def commit(self) -> None:
        if self._buffer is None:
            raise StoreError(f"commit of {self._name} after commit or abort")
        data, self._buffer = self._buffer, None
        self._publish(data)

    def abort(self) -> None:
        self._buffer = None


class Backend(abc.ABC):
    """Named immutable objects. See the module docstring for the contracts."""

    url: str
    #: Whether ``delete(if_version=)`` fails, atomically, for an object touched after that
    #: version was listed (GCS: generation and metageneration preconditions; a local rename).
    #: False (S3: ``If-Match`` names the ETag, which a touch keeps): garbage collection then
    #: condemns a pack a grace period before it deletes it (:mod:`cairn.store.gc`).
    guarded_deletes: bool = True
    #: ``updated``, and a version derived from it, move in steps of this many seconds: a
    #: touch or re-create within one step may leave them unchanged (S3's ``LastModified``: 1).
    version_resolution_seconds: float = 0.0

    @abc.abstractmethod
    def create(self, name: str, data: bytes) -> None:
        """Create ``name`` holding ``data``, create-only and durable on return."""

    @abc.abstractmethod
    def open_writer(self, name: str) -> BlobWriter:
        """Start a streaming create-only upload of ``name``."""

    @abc.abstractmethod
    def read(self, name: str) -> bytes:
        """The whole object. :class:`~cairn.exceptions.NotFound` when it does not exist."""

    @abc.abstractmethod
    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset``; fewer only when the object is shorter."""

    def read_range_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; returns the bytes read (fewer only at the end).

        Backends that can read into caller memory override this to spare an allocation.
        """
        data = self.read_range(name, offset, len(buffer))
        buffer[: len(data)] = data
        return len(data)

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix``, sorted by name."""

    @abc.abstractmethod
    def stat(self, name: str) -> ObjectInfo:
        """:class:`~cairn.exceptions.NotFound` when it does not exist."""

    @abc.abstractmethod
    def delete(self, name: str, *, if_version: str | None = None) -> None:
        """Delete ``name``; with ``if_version``, only while it is still that version
        (:class:`~cairn.exceptions.PreconditionFailed` otherwise). NotFound when absent."""

    @abc.abstractmethod
    def touch(self, name: str) -> None:
        """Mark ``name`` as used now (new ``version`` and ``updated``). NotFound when absent."""

    def close(self) -> None:
        """Release connections and threads. The backend is unusable afterwards."""


def check_object_name(name: str) -> None:
    """Refuse an object name that is empty, absolute or has an empty, ``.`` or ``..``
    component: a bucket backend's names are relative paths below its prefix."""
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
        raise ConfigError(f"invalid object name {name!r}")


def prefixed(prefix: str, name: str) -> str:
    """The bucket's object name for ``name`` below ``prefix`` (empty: the bucket's root)."""
    return f"{prefix}/{name}" if prefix else name
