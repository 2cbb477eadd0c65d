"""Keep the workload's PIDs where a fresh container will not have used them.

CRIU restores every process with the PID it had. A fresh pod hands out PIDs from 1 upward, so
a workload that was started at PID 7 collides on restore with whatever holds 7 in the new
pod. ``cairn run`` therefore moves the PID namespace's cursor (``ns_last_pid``) to a high,
random value just before it starts the workload, and again after a restore (the kernel does
not move the cursor for PIDs that CRIU asks for explicitly, so without it the restored
workload's next children would get low PIDs and the next snapshot would collide). See ADR
0007 for why this and not a PID namespace per workload.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
PID_MAX = "/proc/sys/kernel/pid_max"

T = TypeVar("T")

CLONE_NEWNS = 0x00020000
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
_KEPT_FLAGS = 2 | 4 | 8 | 1024 | 2048  # nosuid, nodev, noexec, noatime, nodiratime


def make_cursor_writable() -> str | None:
    """Containers mount ``/proc/sys`` read-only, which stops ``ns_last_pid`` writes whatever
    the capabilities (measured, ADR 0008). With CAP_SYS_ADMIN, give this process a private
    mount namespace (propagation private, so nothing leaks to the host's or the pod's mounts)
    in which ``/proc/sys`` is remounted writable. The workload started afterwards shares that
    namespace. Call before any thread starts (``unshare(CLONE_NEWNS)`` refuses threads).

    Returns a sentence saying what was done, or None when nothing was needed. Raises OSError
    when it was needed and failed.
    """
    try:
        os.close(os.open(NS_LAST_PID, os.O_WRONLY))
        return None
    except OSError as e:
        if e.errno != errno.EROFS:
            return None  # missing or not permitted: the caller falls back and says why
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    kept = os.statvfs("/proc/sys").f_flag & _KEPT_FLAGS
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    check(libc.mount(b"none", b"/proc/sys", None, MS_REMOUNT | MS_BIND | kept, None),
          "mount -o remount,bind,rw /proc/sys")
    return ("/proc/sys was read-only: remounted writable in a private mount namespace of the "
            "supervisor and its workload")


def pid_max() -> int:
    try:
        with open(PID_MAX) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 32768


def high_pid_base(*, rng: random.Random | None = None) -> int:
    """A random start in the third quarter of the PID space: far above what a fresh
    container uses, with room below the wrap, and spread so that several workloads of one
    host rarely start on top of each other."""
    top = pid_max()
    rng = rng or random.Random()
    return rng.randrange(top // 2, top * 3 // 4)


@contextmanager
def _locked_cursor() -> Iterator[int]:
    # CRIU takes the same flock on ns_last_pid while it restores, so the two never interleave.
    fd = os.open(NS_LAST_PID, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def spawn_at(last_pid: int, spawn: Callable[[], T]) -> T:
    """Set ``ns_last_pid`` to ``last_pid`` and call ``spawn`` (which forks) under the lock, so
    the fork gets ``last_pid + 1`` unless another process forks in between or that PID is in
    use (the kernel then takes the next free one). Raises OSError if the cursor is not
    writable (needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)."""
    with _locked_cursor() as fd:
        os.pwrite(fd, str(last_pid).encode(), 0)
        return spawn()


def advance_past(pids: list[int]) -> None:
    """Move the cursor past the highest of ``pids`` (after a restore), if it is below."""
    if not pids:
        return
    with _locked_cursor() as fd:
        current = int(os.pread(fd, 32, 0) or b"0")
        if current < max(pids):
            os.pwrite(fd, str(max(pids)).encode(), 0)
