"""The file operations the local backend performs, behind one small interface.

Every byte :class:`~cairn.store.local.LocalBackend` writes goes through a :class:`FileOps`, so a
test can record the exact sequence of operations and replay a power loss: only what was
``fsync``-ed before the crash survives (see ``tests/integration/store/test_power_loss.py``).
Methods are thread-safe as far as the underlying syscalls are.
"""

from __future__ import annotations

import os
from typing import Protocol


class FileOps(Protocol):
    """Durability-relevant filesystem calls. Paths are absolute strings."""

    def open_new(self, path: str) -> int:
        """Create ``path`` exclusively (``O_EXCL``) for writing; return a file descriptor."""

    def write(self, fd: int, data: bytes | memoryview) -> None:
        """Write all of ``data`` at the descriptor's position."""

    def fsync(self, fd: int) -> None:
        """Make the file's content durable."""

    def close(self, fd: int) -> None: ...

    def link(self, src: str, dst: str) -> None:
        """Create ``dst`` as a new name for ``src``; ``FileExistsError`` when ``dst`` exists."""

    def rename(self, src: str, dst: str) -> None:
        """Atomically move ``src`` to ``dst`` (used only for names nobody else creates)."""

    def unlink(self, path: str) -> None: ...

    def mkdir(self, path: str) -> None:
        """Create one directory; ``FileExistsError`` when it exists."""

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creations, links, removals) durable."""

    def utime(self, path: str, ns: int) -> None:
        """Set the access and modification times to ``ns`` (GC's notion of "recently used")."""


class OsFileOps:
    """The real thing: thin wrappers over :mod:`os`."""

    def open_new(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def write(self, fd: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o755)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def utime(self, path: str, ns: int) -> None:
        os.utime(path, ns=(ns, ns))


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written
