"""Confined writes: a restore creates or rewrites files only beneath roots it was given.

A restore runs as root with broad capabilities and writes what a manifest from the shared store
names, so nothing in that name is trusted (docs/security.md). :func:`open_beneath` opens a file
for writing beneath a root directory and refuses:

* ``..``, ``.``, empty components, NUL bytes and absolute names (checked before any syscall);
* a symlink at any component, the last one included (``openat2`` with ``RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS`` where the kernel has it, Linux >= 5.6; otherwise a walk that opens
  each component with ``O_NOFOLLOW`` relative to its parent's descriptor, so a name swapped
  for a symlink between two steps is still refused);
* anything but a regular file at the end (a device, a FIFO, a socket, a directory);
* a regular file with more than one link (a hard link planted beside the real target).

The root itself is configured by the restoring side and may be reached through symlinks.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from cairn.exceptions import UnsafePath

log = logging.getLogger("cairn.store")

MODE_MASK = 0o777  # no setuid, setgid or sticky bit ever comes out of a snapshot

_SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc: ctypes.CDLL | None = None
_openat2_works: bool | None = None  # None: not tried yet


def masked_mode(mode: int, *, path: str = "") -> int:
    """``mode`` without the setuid, setgid and sticky bits (logged when any was set)."""
    if mode & ~MODE_MASK:
        log.warning("mode %04o of %s masked to %04o: a restore never sets setuid, setgid or "
                    "sticky bits", mode, path or "a restored file", mode & MODE_MASK)
    return mode & MODE_MASK


def check_name(name: str) -> list[str]:
    """The components of ``name``, a relative path; raises UnsafePath for anything else."""
    if not isinstance(name, str) or not name:
        raise UnsafePath(f"path {name!r} is empty or not text")
    if "\x00" in name:
        raise UnsafePath(f"path {name!r} contains NUL")
    if name.startswith("/"):
        raise UnsafePath(f"path {name!r} is absolute where a relative one is expected")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"path {name!r} has an empty, '.' or '..' component")
    return parts


def _openat2(dir_fd: int, name: str, flags: int, mode: int) -> int | None:
    """``openat2(dir_fd, name, flags, mode, _RESOLVE)``; None when the kernel lacks it."""
    global _libc, _openat2_works
    if _openat2_works is False:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    how = _OpenHow(flags, mode, _RESOLVE)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd),
                       ctypes.c_char_p(os.fsencode(name)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        _openat2_works = True
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and _openat2_works is None:
        # ENOSYS: before Linux 5.6; EPERM: a seccomp profile that forbids it.
        _openat2_works = False
        return None
    raise OSError(err, os.strerror(err), name)


@dataclass(frozen=True)
class Confinement:
    """How :func:`open_beneath` resolves: ``use_openat2=False`` forces the portable walk
    (tests run both)."""

    use_openat2: bool = True


def _refusal(root: str, name: str, e: OSError) -> UnsafePath:
    where = os.path.join(root, name)
    if e.errno == errno.ELOOP:
        why = "a component is a symlink"
    elif e.errno == errno.EXDEV:
        why = "it resolves outside the root"
    elif e.errno == errno.ENOTDIR:
        why = "a component is not a directory"
    else:
        why = e.strerror or str(e)
    return UnsafePath(f"refusing to write {where}: {why}")


def _open_dir(root_fd: int, parts: Sequence[str], *, root: str, make_dirs: bool,
              dir_mode: int, how: Confinement) -> int:
    """A descriptor of the directory ``parts`` beneath ``root_fd``, created as needed."""
    name = "/".join(parts)
    if not parts:
        return os.dup(root_fd)
    if how.use_openat2:
        try:
            fd = _openat2(root_fd, name, _DIR_FLAGS, 0)
        except FileNotFoundError:
            fd = None  # walk, creating what is missing
        except OSError as e:
            raise _refusal(root, name, e) from None
        if fd is not None:
            return fd
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not make_dirs:
                    raise
                try:
                    os.mkdir(part, dir_mode, dir_fd=fd)
                except FileExistsError:
                    pass  # created meanwhile; opened (without following) below
                child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
        return fd
    except OSError as e:
        os.close(fd)
        if isinstance(e, FileNotFoundError):
            raise
        raise _refusal(root, name, e) from None


def open_beneath(root: str, name: str, *, flags: int = os.O_WRONLY | os.O_CREAT,
                 mode: int = 0o644, make_dirs: bool = True, dir_mode: int = 0o755,
                 how: Confinement = Confinement()) -> int:
    """Open ``root/name`` for writing, never leaving ``root``; returns a descriptor.

    ``name`` is relative (see :func:`check_name`). ``flags`` are added to ``O_NOFOLLOW |
    O_NONBLOCK | O_NOCTTY | O_CLOEXEC``; ``O_TRUNC`` is refused (truncate after the checks).
    Missing directories are created with ``dir_mode`` when ``make_dirs``. The target, when it
    exists, must be a regular file with one link. Raises :class:`UnsafePath` naming the reason;
    ``FileNotFoundError`` when a directory is missing and ``make_dirs`` is false."""
    if flags & os.O_TRUNC:
        raise ValueError("open_beneath truncates nothing before its checks; truncate the "
                         "returned descriptor")
    parts = check_name(name)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        dir_fd = _open_dir(root_fd, parts[:-1], root=root, make_dirs=make_dirs,
                           dir_mode=dir_mode, how=how)
    finally:
        os.close(root_fd)
    try:
        leaf = parts[-1]
        try:
            before = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            before = None
        if before is not None:
            _check_target(root, name, before)
        # O_NONBLOCK: a FIFO swapped in after the stat must not block the open.
        full = flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(leaf, full, mode, dir_fd=dir_fd)
        except OSError as e:
            raise _refusal(root, name, e) from None
    finally:
        os.close(dir_fd)
    try:
        after = os.fstat(fd)
        _check_target(root, name, after)
        if before is not None and (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
            raise UnsafePath(f"refusing to write {os.path.join(root, name)}: it was replaced "
                             "while being opened")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_target(root: str, name: str, st: os.stat_result) -> None:
    where = os.path.join(root, name)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"refusing to write {where}: it is a symlink")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        raise UnsafePath(f"refusing to write {where}: it is {kind}")
    if st.st_nlink > 1:
        raise UnsafePath(f"refusing to write {where}: it has {st.st_nlink} hard links (one may "
                         "be a file outside the roots)")


def normalize_roots(roots: Sequence[str]) -> tuple[str, ...]:
    """Absolute, symlink-free, de-duplicated roots, longest first; '' entries are dropped.
    Raises UnsafePath for ``/`` (a root must confine something)."""
    out: list[str] = []
    for root in roots:
        if not root:
            continue
        real = os.path.realpath(root)
        if real == "/":
            raise UnsafePath(f"track root {root!r} is '/', which confines nothing; name the "
                             "directories the workload appends to")
        if real not in out:
            out.append(real)
    return tuple(sorted(out, key=len, reverse=True))


def split_under(path: str, roots: Sequence[str]) -> tuple[str, str]:
    """``(root, relative name)`` of the absolute ``path`` under the longest of ``roots``
    (normalized, see :func:`normalize_roots`). Purely lexical: ``path`` must be absolute and
    normal (no ``..``, ``.``, ``//``). Raises UnsafePath naming the roots otherwise."""
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise UnsafePath(f"path {path!r} is not an absolute path")
    if os.path.normpath(path) != path or path.startswith("//"):
        raise UnsafePath(f"path {path!r} is not normal (it has '..', '.' or '//')")
    for root in roots:
        if path.startswith(root + "/"):
            rel = path[len(root) + 1:]
            check_name(rel)
            return root, rel
    raise UnsafePath(f"path {path!r} is outside the track roots {', '.join(roots) or '(none)'}")
