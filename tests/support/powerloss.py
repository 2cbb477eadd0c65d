"""A power-loss simulator for :class:`~cairn.store.local.LocalBackend`.

:class:`RecordingFileOps` performs every :class:`~cairn.store.fileops.FileOps` call for real and
records it. :func:`replay_durable` rebuilds what a power loss right after a given number of
recorded operations could leave on disk, under the classic pessimistic model:

* a file's contents survive only as of its last ``fsync``; a file never fsynced is empty;
* a directory entry (made by ``open_new``, ``link``, ``rename``, ``mkdir``, or removed by
  ``unlink``/``rename``) survives only if its directory was ``fsync_dir``-ed afterwards;
  otherwise the directory keeps the entries it had at its last ``fsync_dir`` (none for a
  directory created during the recording).

The model is keyed by inode: ``link`` adds a second name for one inode and ``rename`` moves a
name, so data fsynced through a temporary name is durable under the published name too.
Recording starts from an empty root directory whose own existence is durable.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from cairn.store.fileops import FileOps, OsFileOps


@dataclass(frozen=True)
class Op:
    """One recorded call. Paths are relative to the recorder's root (``""`` is the root)."""

    name: str
    path: str = ""
    path2: str = ""
    fd: int = -1
    data: bytes = b""


class RecordingFileOps:
    """Performs each FileOps call on ``inner`` and records it, in one global order.

    Calls are serialised under a lock, so the record is a real linearisation of what the
    (multi-threaded) store did. A failed call changed nothing and is not recorded.
    """

    def __init__(self, root: str, inner: FileOps | None = None) -> None:
        self.root = os.path.abspath(root)
        if os.listdir(self.root):
            raise ValueError(f"record from an empty root; {self.root} is not empty")
        self.inner = inner or OsFileOps()
        self.ops: list[Op] = []
        self.fd_paths: dict[int, str] = {}
        self._lock = threading.RLock()
        self._recording = True

    def rel(self, path: str) -> str:
        """``path`` relative to the root (``""`` for the root itself)."""
        rel = os.path.relpath(path, self.root)
        if rel == ".." or rel.startswith("../"):
            raise ValueError(f"{path} is outside the recorded root {self.root}")
        return "" if rel == "." else rel

    def stop(self) -> list[Op]:
        """Stop recording (calls still happen) and return the operations recorded so far."""
        with self._lock:
            self._recording = False
            return list(self.ops)

    def count(self) -> int:
        with self._lock:
            return len(self.ops)

    def _record(self, op: Op) -> None:
        if self._recording:
            self.ops.append(op)

    # -- FileOps -------------------------------------------------------------------------

    def open_new(self, path: str) -> int:
        with self._lock:
            fd = self.inner.open_new(path)
            self.fd_paths[fd] = self.rel(path)
            self._record(Op("open_new", self.rel(path), fd=fd))
            return fd

    def write(self, fd: int, data: bytes | memoryview) -> None:
        with self._lock:
            self.inner.write(fd, data)
            self._record(Op("write", self.fd_paths[fd], fd=fd, data=bytes(data)))

    def fsync(self, fd: int) -> None:
        with self._lock:
            self.inner.fsync(fd)
            self._record(Op("fsync", self.fd_paths[fd], fd=fd))

    def close(self, fd: int) -> None:
        with self._lock:
            self.inner.close(fd)
            self._record(Op("close", self.fd_paths.pop(fd), fd=fd))

    def link(self, src: str, dst: str) -> None:
        with self._lock:
            self.inner.link(src, dst)
            self._record(Op("link", self.rel(src), self.rel(dst)))

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            self.inner.rename(src, dst)
            self._record(Op("rename", self.rel(src), self.rel(dst)))

    def unlink(self, path: str) -> None:
        with self._lock:
            self.inner.unlink(path)
            self._record(Op("unlink", self.rel(path)))

    def mkdir(self, path: str) -> None:
        with self._lock:
            self.inner.mkdir(path)
            self._record(Op("mkdir", self.rel(path)))

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self.inner.fsync_dir(path)
            if not self.outside(path):
                self._record(Op("fsync_dir", self.rel(path)))

    def outside(self, path: str) -> bool:
        """True for the root's parent: the model takes the root's own entry as durable."""
        return os.path.abspath(path) == os.path.dirname(self.root)

    def utime(self, path: str, ns: int) -> None:
        with self._lock:
            self.inner.utime(path, ns)
            self._record(Op("utime", self.rel(path)))


class LossyFileOps(RecordingFileOps):
    """A recorder whose ``fsync`` or ``fsync_dir`` silently does nothing for some paths.

    ``skip`` is ``"fsync"`` or ``"fsync_dir"``; a call is skipped (neither performed nor
    recorded) when the file's or directory's relative path starts with ``under``. It stands
    for a backend that forgot a sync, to show that the simulator catches one.
    """

    def __init__(self, root: str, *, skip: str, under: str) -> None:
        if skip not in ("fsync", "fsync_dir"):
            raise ValueError(f"skip must be 'fsync' or 'fsync_dir', not {skip!r}")
        super().__init__(root)
        self.skip = skip
        self.under = under

    def fsync(self, fd: int) -> None:
        if self.skip == "fsync" and self.fd_paths[fd].startswith(self.under):
            return
        super().fsync(fd)

    def fsync_dir(self, path: str) -> None:
        if self.skip == "fsync_dir" and not self.outside(path) and self.rel(path).startswith(self.under):
            return
        super().fsync_dir(path)


# -- replay ----------------------------------------------------------------------------------


class _Disk:
    """The volatile (page cache) and durable views of the recorded filesystem, by inode."""

    ROOT = 0

    def __init__(self) -> None:
        self.is_dir: dict[int, bool] = {self.ROOT: True}
        self.live: dict[int, dict[str, int]] = {self.ROOT: {}}  # dir inode -> name -> inode
        self.durable: dict[int, dict[str, int]] = {self.ROOT: {}}  # as of the last fsync_dir
        self.content: dict[int, bytearray] = {}  # file inode -> bytes written so far
        self.synced: dict[int, bytes] = {}  # file inode -> bytes as of its last fsync
        self.fds: dict[int, int] = {}  # open fd -> file inode
        self._next = 1

    def _new(self, is_dir: bool) -> int:
        ino, self._next = self._next, self._next + 1
        self.is_dir[ino] = is_dir
        if is_dir:
            self.live[ino] = {}
            self.durable[ino] = {}
        else:
            self.content[ino] = bytearray()
        return ino

    def _dir_of(self, path: str) -> tuple[int, str]:
        """The inode of ``path``'s parent directory (live view) and ``path``'s last name."""
        *parents, name = path.split("/")
        ino = self.ROOT
        for part in parents:
            ino = self.live[ino][part]
            assert self.is_dir[ino], f"{part} in {path} is not a directory"
        return ino, name

    def _lookup(self, path: str) -> int:
        if path == "":
            return self.ROOT
        parent, name = self._dir_of(path)
        return self.live[parent][name]

    def apply(self, op: Op) -> None:
        if op.name == "open_new":
            parent, name = self._dir_of(op.path)
            assert name not in self.live[parent], f"open_new of existing {op.path}"
            ino = self._new(is_dir=False)
            self.live[parent][name] = ino
            self.fds[op.fd] = ino
        elif op.name == "write":
            self.content[self.fds[op.fd]] += op.data  # FileOps writes are sequential appends
        elif op.name == "fsync":
            ino = self.fds[op.fd]
            self.synced[ino] = bytes(self.content[ino])
        elif op.name == "close":
            del self.fds[op.fd]
        elif op.name == "link":
            ino = self._lookup(op.path)
            parent, name = self._dir_of(op.path2)
            assert name not in self.live[parent], f"link onto existing {op.path2}"
            self.live[parent][name] = ino
        elif op.name == "rename":
            src_parent, src_name = self._dir_of(op.path)
            ino = self.live[src_parent].pop(src_name)
            dst_parent, dst_name = self._dir_of(op.path2)
            self.live[dst_parent][dst_name] = ino
        elif op.name == "unlink":
            parent, name = self._dir_of(op.path)
            del self.live[parent][name]
        elif op.name == "mkdir":
            parent, name = self._dir_of(op.path)
            assert name not in self.live[parent], f"mkdir of existing {op.path}"
            self.live[parent][name] = self._new(is_dir=True)
        elif op.name == "fsync_dir":
            ino = self._lookup(op.path)
            self.durable[ino] = dict(self.live[ino])
        elif op.name != "utime":  # a timestamp is not durability-relevant here
            raise ValueError(f"unknown operation {op.name!r}")

    def materialize(self, target: str) -> None:
        """Write the durable view: the tree reachable from the root via durable entries."""
        placed: dict[int, str] = {}  # file inode -> first path written (later names link it)

        def walk(dir_ino: int, dir_path: str) -> None:
            for name, ino in sorted(self.durable[dir_ino].items()):
                path = os.path.join(dir_path, name)
                if self.is_dir[ino]:
                    os.mkdir(path)
                    walk(ino, path)
                elif ino in placed:
                    os.link(placed[ino], path)
                else:
                    with open(path, "wb") as f:
                        f.write(self.synced.get(ino, b""))
                    placed[ino] = path

        walk(self.ROOT, target)


def replay_durable(ops: list[Op], upto: int, target_dir: str) -> None:
    """Write into the empty ``target_dir`` what survives a power loss after ``ops[:upto]``."""
    if not 0 <= upto <= len(ops):
        raise ValueError(f"upto {upto} is outside 0..{len(ops)}")
    if os.listdir(target_dir):
        raise ValueError(f"replay into an empty directory; {target_dir} is not empty")
    disk = _Disk()
    for op in ops[:upto]:
        disk.apply(op)
    disk.materialize(target_dir)
