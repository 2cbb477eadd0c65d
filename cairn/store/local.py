"""LocalBackend: objects as files under a directory, published create-only.

A create writes a temporary file in the target directory, fsyncs it, publishes it with
``link()`` (which, unlike ``rename``, refuses to replace an existing name) and fsyncs the
directory. When :meth:`LocalBackend.create` returns, the object survives a power loss.

NFS and FUSE filesystems (gcsfuse among them) do not give ``link()`` and ``fsync`` these
meanings, so a store on one is refused with a message that names the remote stores' forms.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections.abc import Iterator

from cairn.exceptions import (
    AlreadyExists,
    ConfigError,
    NotFound,
    PreconditionFailed,
    StoreError,
    StoreUnreachable,
    UnsupportedFilesystem,
)
from cairn.store.aligned import DIRECT_IO_ALIGN, DIRECT_IO_MIN, aligned_buffer, direct_length
from cairn.store.backend import Backend, BlobWriter, ObjectInfo
from cairn.store.fileops import FileOps, OsFileOps
from cairn.store.kind_file import path_of
from cairn.store.kinds import url_forms

TEMP_PREFIX = ".tmp."
TRASH_PREFIX = ".gc."

# Filesystem types whose link()/fsync semantics a create-only commit cannot rely on.
_REFUSED_FS_PREFIXES = ("nfs", "fuse", "cifs", "smb", "9p", "ceph", "glusterfs", "lustre", "davfs")


def filesystem_type(path: str) -> str:
    """The type (``ext4``, ``nfs4``, ``fuse.gcsfuse``...) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point = fields[4].replace("\\040", " ")
                fs_type = fields[fields.index("-") + 1]
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fs_type
    except OSError:
        return "unknown"
    return best_type


def check_filesystem(path: str) -> None:
    """Raise :class:`UnsupportedFilesystem` when ``path`` is on NFS, FUSE or similar."""
    fs_type = filesystem_type(path)
    if fs_type.startswith(_REFUSED_FS_PREFIXES):
        raise UnsupportedFilesystem(
            f"the store directory {path!r} is on a {fs_type} filesystem, which cannot publish "
            f"snapshots create-only and durably; use a local disk, or a bucket "
            f"({url_forms(remote=True)}) instead of a mounted one"
        )


def _version(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns}-{st.st_ino}"


def open_url(url: str, *, create: bool = True,
             connect_timeout: float | None = None) -> LocalBackend:
    """The ``file`` kind's opener (:mod:`cairn.store.kind_file`); a directory has no
    connect timeout."""
    del connect_timeout
    return LocalBackend(path_of(url), create=create)


class LocalBackend(Backend):
    """Objects as files below ``root``. See the module docstring for the guarantees."""

    def __init__(self, root: str, *, fileops: FileOps | None = None, create: bool = True) -> None:
        root = os.path.abspath(root)
        existing = root
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        check_filesystem(existing)
        if os.path.exists(root) and not os.path.isdir(root):
            raise ConfigError(f"the store path {root!r} is a file; give a directory")
        self.root = root
        self.url = "file://" + root
        self._ops = fileops or OsFileOps()
        # Directories whose entry in their parent is known to be durable.
        self._durable_dirs: set[str] = set()
        self._dirs_lock = threading.Lock()
        self._direct_io = True  # until the filesystem refuses O_DIRECT
        if create:
            try:
                self._make_root(root)
            except OSError as e:
                # Not an I/O error to retry: the worker lacks the directory (a volume not
                # mounted here, a read-only filesystem, a path below a file), so no try starts.
                raise StoreUnreachable(
                    f"cannot create the store directory {root} ({e.strerror or e}): check the "
                    "path is right and writable from this worker (is the volume that holds it "
                    "mounted here?); no try starts without the store's history of this step",
                    url=self.url, reason=e.strerror or type(e).__name__) from e
        elif not os.path.isdir(root):
            raise NotFound(f"no cairn store at {root!r}; check the path, or write a snapshot "
                           "there first with `cairn put`")

    def _make_root(self, root: str) -> None:
        missing = []
        probe = root
        while not os.path.isdir(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        self._mkdirs(missing)
        # An existing root may have been made by a process that died before making it durable.
        self._make_durable(missing or [root])

    # -- paths -------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
            raise ConfigError(f"invalid object name {name!r}")
        return os.path.join(self.root, name)

    def _ensure_dir(self, path: str) -> list[str]:
        """Create ``path`` and its missing parents; return those not yet known durable.

        The caller fsyncs their parents (:meth:`_make_durable`) before it publishes anything
        inside them. That fsync is left to the publisher, which runs on a pool thread, because
        a directory fsync waits for the journal and would stall the thread filling packs.
        """
        pending = []
        probe = path
        while probe != self.root and probe not in self._durable_dirs:
            pending.append(probe)
            probe = os.path.dirname(probe)
        self._mkdirs(pending)
        return pending

    def _mkdirs(self, directories: list[str]) -> None:
        """Create each directory (listed deepest first), parents first; existing ones are fine."""
        for directory in reversed(directories):
            try:
                self._ops.mkdir(directory)
            except FileExistsError:
                pass

    def _make_durable(self, directories: list[str]) -> None:
        """Fsync the parent of each directory (made by :meth:`_ensure_dir`), top-down."""
        for directory in reversed(directories):
            if directory in self._durable_dirs:
                continue
            self._ops.fsync_dir(os.path.dirname(directory))
            with self._dirs_lock:
                self._durable_dirs.add(directory)

    def _publish(self, temp: str, final: str, new_dirs: list[str]) -> None:
        self._make_durable(new_dirs)
        try:
            self._ops.link(temp, final)
        except FileExistsError:
            raise AlreadyExists(f"{final} already exists") from None
        finally:
            self._ops.unlink(temp)
        self._ops.fsync_dir(os.path.dirname(final))

    # -- Backend -----------------------------------------------------------------------

    def create(self, name: str, data: bytes) -> None:
        with self.open_writer(name) as writer:
            writer.write(data)
            writer.commit()

    def open_writer(self, name: str) -> BlobWriter:
        final = self._path(name)
        new_dirs = self._ensure_dir(os.path.dirname(final))
        return _LocalBlobWriter(self, final, new_dirs)

    def read(self, name: str) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None
        try:
            first = os.pread(fd, length, offset)
            if len(first) == length or not first:
                return first
            parts = [first]
            got = len(first)
            while got < length:
                piece = os.pread(fd, length - got, offset + got)
                if not piece:
                    break
                parts.append(piece)
                got += len(piece)
            return b"".join(parts)
        finally:
            os.close(fd)

    def read_range_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """See :meth:`Backend.read_range_into`. A large read at an aligned offset into
        aligned memory bypasses the page cache (``O_DIRECT``, :mod:`cairn.store.aligned`)
        where the filesystem allows it; other reads go through the cache."""
        path = self._path(name)
        bulk = direct_length(offset, buffer) if self._direct_io else 0
        if bulk:
            got = self._read_direct(path, name, offset, buffer, bulk)
            if got is not None:
                return got
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None
        try:
            if len(buffer) < DIRECT_IO_MIN:
                # One small chunk: readahead would pull in its neighbours, which a restore
                # reads directly. Large reads keep readahead (it speeds up streaming reads).
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            return _pread_into(fd, buffer, offset)
        finally:
            os.close(fd)

    def _read_direct(self, path: str, name: str, offset: int, buffer: memoryview,
                     bulk: int) -> int | None:
        """Read with ``O_DIRECT``: the aligned ``bulk`` straight into ``buffer``, an unaligned
        tail through one aligned block of bounce memory. None (and no more direct reads from
        this backend) where the filesystem refuses it."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct_io = False  # tmpfs before Linux 6.6, some FUSE and overlay mounts
            return None
        try:
            got = _pread_into(fd, buffer[:bulk], offset)
            if got < bulk or got == len(buffer):
                return got  # the object ended inside the bulk, or there is no tail
            block = memoryview(aligned_buffer(DIRECT_IO_ALIGN))
            tail = min(_pread_into(fd, block, offset + got), len(buffer) - got)
            buffer[got:got + tail] = block[:tail]
            return got + tail
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # A device whose blocks are larger than DIRECT_IO_ALIGN: read through the cache.
            self._direct_io = False
            return None
        finally:
            os.close(fd)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = os.path.join(self.root, prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for filename in filenames:
                if filename.startswith("."):
                    continue
                name = filename if rel_dir == "." else f"{rel_dir}/{filename}"
                if not name.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, filename))
                except FileNotFoundError:
                    continue
                found.append(ObjectInfo(name, st.st_size, _version(st), st.st_mtime_ns / 1e9))
        found.sort(key=lambda info: info.name)
        return iter(found)

    def stat(self, name: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None
        return ObjectInfo(name, st.st_size, _version(st), st.st_mtime_ns / 1e9)

    def delete(self, name: str, *, if_version: str | None = None) -> None:
        path = self._path(name)
        directory = os.path.dirname(path)
        if if_version is None:
            try:
                self._ops.unlink(path)
            except FileNotFoundError:
                raise NotFound(f"{name} does not exist in {self.url}") from None
            self._ops.fsync_dir(directory)
            return
        # Move it out of sight first, then check: a touch that lands before the move shows
        # in the version; one that lands after it finds no file and re-creates the object.
        trash = os.path.join(directory, f"{TRASH_PREFIX}{uuid.uuid4().hex}")
        try:
            self._ops.rename(path, trash)
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None
        if _version(os.stat(trash)) != if_version:
            try:
                self._ops.link(trash, path)
            except FileExistsError:
                pass  # re-created meanwhile; the new one stays
            self._ops.unlink(trash)
            self._ops.fsync_dir(directory)
            raise PreconditionFailed(f"{name} changed since it was listed; not deleted")
        self._ops.unlink(trash)
        self._ops.fsync_dir(directory)

    def touch(self, name: str) -> None:
        path = self._path(name)
        try:
            st = os.stat(path)
            # The kernel's clock for mtime is coarse (a tick); force a strictly newer value so
            # that every touch changes the version a concurrent GC compares against.
            now = max(time.time_ns(), st.st_mtime_ns + 1)
            self._ops.utime(path, now)
        except FileNotFoundError:
            raise NotFound(f"{name} does not exist in {self.url}") from None

    def remove_stale_temporaries(self, *, older_than: float) -> int:
        """Delete temp and trash files a crashed writer or GC left behind. Returns the count."""
        removed = 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for filename in filenames:
                if not filename.startswith((TEMP_PREFIX, TRASH_PREFIX)):
                    continue
                path = os.path.join(dirpath, filename)
                try:
                    if os.stat(path).st_mtime < older_than:
                        self._ops.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed


class _LocalBlobWriter(BlobWriter):
    def __init__(self, backend: LocalBackend, final: str, new_dirs: list[str]) -> None:
        self._backend = backend
        self._final = final
        self._new_dirs = new_dirs
        self._temp = os.path.join(os.path.dirname(final), f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        self._ops = backend._ops
        try:
            self._fd: int | None = self._ops.open_new(self._temp)
        except OSError as e:
            raise StoreError(f"cannot write in {os.path.dirname(final)}: {e}") from e
        self._done = False

    def write(self, data: bytes | memoryview) -> None:
        if self._fd is None:
            raise StoreError("write after commit or abort")
        try:
            self._ops.write(self._fd, data)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StoreError(f"no space left on the device holding {self._final}") from e
            raise StoreError(f"cannot write {self._final}: {e}") from e

    def commit(self) -> None:
        if self._fd is None:
            raise StoreError("commit after commit or abort")
        fd, self._fd = self._fd, None
        try:
            self._ops.fsync(fd)
            _drop_cached_pages(fd)
        finally:
            self._ops.close(fd)
        self._done = True
        self._backend._publish(self._temp, self._final, self._new_dirs)

    def abort(self) -> None:
        if self._fd is not None:
            self._ops.close(self._fd)
            self._fd = None
        if not self._done:
            self._done = True
            try:
                self._ops.unlink(self._temp)
            except FileNotFoundError:
                pass


def _pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Fill ``buffer`` from ``offset``; fewer bytes only at the end of the file."""
    got = 0
    while got < len(buffer):
        n = os.preadv(fd, [buffer[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _drop_cached_pages(fd: int) -> None:
    """Once a file is durable, ask the kernel to drop its (now clean) pages from the page cache.

    A snapshot writes the state's whole size in a few seconds; left cached, those pages push the
    trainer's working set out and its allocations into direct reclaim (measured: training steps
    2.5x slower while a 1.5 GB persist runs on the 2-core dev VM). Best effort: a restore just
    reads them from disk again.
    """
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
