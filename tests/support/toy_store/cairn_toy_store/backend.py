"""The toy store's backend: each object one file in its bucket's directory, its name encoded
(``/`` as ``%2F``), published create-only with ``link()``; uploads in ``.uploads``.

A conditional delete is atomic only within one process (a lock): enough for the tests that
run it, not for a real store."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from urllib.parse import quote, unquote

from cairn.exceptions import AlreadyExists, ConfigError, NotFound, PreconditionFailed
from cairn.store.backend import Backend, BlobWriter, ObjectInfo

from cairn_toy_store.kind import ROOT_ENV, TOKEN_ENV, bucket_and_prefix


def open_url(url: str, *, create: bool = True,
             connect_timeout: float | None = None) -> ToyBackend:
    del connect_timeout
    bucket, prefix = bucket_and_prefix(url)
    root = os.environ.get(ROOT_ENV)
    if not root:
        raise ConfigError(f"{url!r}: set {ROOT_ENV} to the toy store's root directory")
    token = os.environ.get(TOKEN_ENV)
    if token is not None and not os.path.isfile(token):
        raise ConfigError(f"{TOKEN_ENV}={token} is not a file")
    return ToyBackend(root, bucket, prefix, create=create)


class ToyBackend(Backend):
    def __init__(self, root: str, bucket: str, prefix: str, *, create: bool) -> None:
        self.url = f"toy://{bucket}/{prefix}" if prefix else f"toy://{bucket}"
        self._dir = os.path.join(root, bucket)
        self._prefix = prefix + "/" if prefix else ""
        self._uploads = os.path.join(self._dir, ".uploads")
        self._lock = threading.Lock()
        if create:
            os.makedirs(self._uploads, exist_ok=True)
        elif not os.path.isdir(self._dir):
            raise NotFound(f"no toy bucket {bucket!r} under {root}")

    def _file(self, name: str) -> str:
        return os.path.join(self._dir, quote(self._prefix + name, safe=""))

    def _info(self, name: str, path: str) -> ObjectInfo:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None
        return ObjectInfo(name=name, size=st.st_size, version=f"{st.st_ino}-{st.st_mtime_ns}",
                          updated=st.st_mtime)

    def create(self, name: str, data: bytes) -> None:
        with self.open_writer(name) as writer:
            writer.write(data)
            writer.commit()

    def open_writer(self, name: str) -> BlobWriter:
        return _ToyWriter(self, self._file(name))

    def read(self, name: str) -> bytes:
        try:
            with open(self._file(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        try:
            with open(self._file(name), "rb") as f:
                f.seek(offset)
                return f.read(length)
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        wanted = self._prefix + prefix
        try:
            entries = os.listdir(self._dir)
        except FileNotFoundError:
            return iter(())
        names = sorted(unquote(e) for e in entries if not e.startswith("."))
        found = []
        for full in names:
            if full.startswith(wanted):
                name = full[len(self._prefix):]
                try:
                    found.append(self._info(name, self._file(name)))
                except NotFound:
                    pass  # deleted meanwhile
        return iter(found)

    def stat(self, name: str) -> ObjectInfo:
        return self._info(name, self._file(name))

    def delete(self, name: str, *, if_version: str | None = None) -> None:
        path = self._file(name)
        with self._lock:
            current = self._info(name, path)
            if if_version is not None and current.version != if_version:
                raise PreconditionFailed(f"{name} is no longer version {if_version}")
            os.unlink(path)

    def touch(self, name: str) -> None:
        """A new file with the same bytes replaces the object: a new inode, a new version."""
        path = self._file(name)
        with self._lock:
            temp = os.path.join(self._uploads, uuid.uuid4().hex)
            try:
                with open(path, "rb") as src, open(temp, "wb") as dst:
                    dst.write(src.read())
                    dst.flush()
                    os.fsync(dst.fileno())
            except FileNotFoundError:
                raise NotFound(f"{name} does not exist in {self.url}") from None
            os.replace(temp, path)


class _ToyWriter(BlobWriter):
    def __init__(self, backend: ToyBackend, final: str) -> None:
        self._final = final
        self._temp = os.path.join(backend._uploads, uuid.uuid4().hex)
        self._file = open(self._temp, "wb")  # noqa: SIM115 - closed by commit or abort
        self._done = False

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        try:
            os.link(self._temp, self._final)
        except FileExistsError:
            raise AlreadyExists(f"{self._final} already exists") from None
        finally:
            self._done = True
            os.unlink(self._temp)
        fd = os.open(os.path.dirname(self._final), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._file.close()
            os.unlink(self._temp)
