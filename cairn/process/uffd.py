"""userfaultfd as ``criu restore --lazy-pages`` hands it over (ADR 0026).

CRIU 4.1.1 (``criu/uffd.c``): every restored task opens a userfaultfd (``O_NONBLOCK``, API
negotiated with ``UFFD_FEATURE_EVENT_FORK | EVENT_REMAP | EVENT_REMOVE | EVENT_UNMAP``)
and, over the one connection CRIU made to ``lazy-pages.socket`` in the restore's work
directory (the images directory), sends its PID as an ``int32`` (negative for a zombie,
which sends nothing else), then the descriptor with ``SCM_RIGHTS`` over one dummy byte. The restorer registers the task's lazy
VMAs (``MODE_MISSING``) and closes its own copy. When the whole tree is restored CRIU sends
``LAZY_PAGES_RESTORE_FINISHED`` (``int32``) and closes the connection. From then on the
holder of the descriptors is the only thing that can fill the missing pages: if it closes
them, the kernel unregisters the ranges and the tasks read zeros there.

This module only speaks those two protocols (the socket, the kernel's ioctls); what to copy
where is :mod:`cairn.process.lazy_handler`'s business.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
from dataclasses import dataclass

SOCKET_NAME = "lazy-pages.socket"
RESTORE_FINISHED = 0x52535446  # "RSTF"; larger than any PID (pid_max <= 2**22)

# <linux/userfaultfd.h>
EVENT_PAGEFAULT = 0x12
EVENT_FORK = 0x13
EVENT_REMAP = 0x14
EVENT_REMOVE = 0x15
EVENT_UNMAP = 0x16
MSG = struct.Struct("<BBHI24s")  # struct uffd_msg: event, reserved, then the union (24 bytes)
_COPY = struct.Struct("<QQQQq")  # struct uffdio_copy: dst, src, len, mode, copy
_ZERO = struct.Struct("<QQQq")  # struct uffdio_zeropage: range(start, len), mode, zeropage
_RANGE = struct.Struct("<QQ")


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


def _ior(nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (0xAA << 8) | nr


UFFDIO_WAKE = _ior(0x02, _RANGE.size)
UFFDIO_COPY = _iowr(0x03, _COPY.size)
UFFDIO_ZEROPAGE = _iowr(0x04, _ZERO.size)


@dataclass(frozen=True)
class Event:
    """One ``uffd_msg``: ``kind`` (an ``EVENT_*``) and its fields: the faulting address
    (``a``) of a page fault; the child's new descriptor (``a``) of a fork; ``from``, ``to``,
    ``len`` (``a``, ``b``, ``c``) of a remap; ``start``, ``end`` (``a``, ``b``) of a remove or
    an unmap."""

    kind: int
    a: int
    b: int = 0
    c: int = 0


def parse_events(data: bytes) -> list[Event]:
    """The messages of one ``read`` of a userfaultfd (a whole number of ``uffd_msg``)."""
    out = []
    for pos in range(0, len(data) - MSG.size + 1, MSG.size):
        kind, _, _, _, arg = MSG.unpack_from(data, pos)
        if kind == EVENT_PAGEFAULT:
            _flags, address, _ = struct.unpack("<QQQ", arg)
            out.append(Event(kind, address))
        elif kind == EVENT_FORK:
            out.append(Event(kind, struct.unpack_from("<I", arg)[0]))
        else:
            a, b, c = struct.unpack("<QQQ", arg)
            out.append(Event(kind, a, b, c))
    return out


def read_events(fd: int) -> list[Event] | None:
    """Every message queued on ``fd`` (none when it would block); None at end of file."""
    try:
        data = os.read(fd, MSG.size * 64)
    except BlockingIOError:
        return []
    if not data:
        return None
    return parse_events(data)


def copy(fd: int, dst: int, src: int, length: int) -> tuple[int, int]:
    """``UFFDIO_COPY`` of ``length`` bytes from our address ``src`` to ``dst`` of the
    process behind ``fd``, waking its waiters there: ``(bytes copied, errno or 0)``.

    The kernel stops at the first page it cannot fill: ``EEXIST`` (already present),
    ``EAGAIN`` (the mapping is changing: read the queued event first, or a partial copy),
    ``ENOENT`` (no single registered VMA covers the range), ``ESRCH`` (the process is gone)."""
    arg = bytearray(_COPY.pack(dst, src, length, 0, 0))
    try:
        fcntl.ioctl(fd, UFFDIO_COPY, arg, True)
    except OSError as e:
        done = _COPY.unpack(arg)[4]
        return max(done, 0), e.errno or errno.EIO
    return length, 0


def zeropage(fd: int, dst: int, length: int) -> int:
    """``UFFDIO_ZEROPAGE``: map zero pages at ``dst``; the errno, or 0."""
    arg = bytearray(_ZERO.pack(dst, length, 0, 0))
    try:
        fcntl.ioctl(fd, UFFDIO_ZEROPAGE, arg, True)
    except OSError as e:
        return e.errno or errno.EIO
    return 0


def wake(fd: int, start: int, length: int) -> None:
    """``UFFDIO_WAKE``: wake whatever waits on ``[start, start + length)``."""
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, UFFDIO_WAKE, _RANGE.pack(start, length))


class HandoverListener:
    """The ``lazy-pages.socket`` that ``criu restore --lazy-pages`` connects to, in
    ``work_dir``. Owned by one thread: :meth:`accept`, then :meth:`receive` until it returns
    the end of the restore."""

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, SOCKET_NAME)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._dir_fd: int | None = None
        target = self.path
        if len(os.fsencode(target)) >= 100:  # sun_path is 108 bytes: bind through the dir fd
            self._dir_fd = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            target = f"/proc/self/fd/{self._dir_fd}/{SOCKET_NAME}"
        self._listener.bind(target)
        self._listener.listen(1)
        self.conn: socket.socket | None = None

    def fileno(self) -> int:
        return self._listener.fileno()

    def accept(self) -> socket.socket:
        conn, _ = self._listener.accept()
        self.conn = conn
        return conn

    def receive(self) -> tuple[str, int, int | None]:
        """The next message of the restore: ``("uffd", pid, fd)`` for a task's descriptor,
        ``("zombie", pid, None)``, ``("finished", 0, None)``, or ``("closed", 0, None)`` when
        CRIU closed the connection without finishing (its restore failed). Blocks."""
        assert self.conn is not None
        head = b""
        while len(head) < 4:
            piece = self.conn.recv(4 - len(head))
            if not piece:
                return ("closed", 0, None)
            head += piece
        (pid,) = struct.unpack("<i", head)
        if pid == RESTORE_FINISHED:
            return ("finished", 0, None)
        if pid < 0:
            return ("zombie", -pid, None)
        msg, fds, _, _ = socket.recv_fds(self.conn, 1, 1, socket.MSG_CMSG_CLOEXEC)
        if not fds:
            raise ConnectionError(f"criu restore sent pid {pid} without its userfaultfd")
        for extra in fds[1:]:
            os.close(extra)
        return ("uffd", pid, fds[0])

    def close(self) -> None:
        for sock in (self.conn, self._listener):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)
