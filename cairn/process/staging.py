"""Where a dump's staging directory goes: memory (tmpfs) when the image fits there, else disk.

CRIU keeps the workload frozen until it has written every page into the image directory, so
the medium of that directory sets the frozen time: on tmpfs a page costs one memory copy, on
disk it also costs the page cache's share of the disk (ADR 0020). A memory-backed directory
holds the whole image in RAM until the ingest is done, though, and that RAM is charged to the
memory cgroup of the step: staging there is only safe when the headroom covers the image.

The policy (:class:`StagingMedium`) is checked per dump, against the image the last dump
wrote (an estimate before the first one):

* ``DISK``: always the work directory's ``staging/``;
* ``MEMORY``: always the memory directory (a warning when the headroom looks too small);
* ``AUTO``: disk while the disk's page cache takes :data:`MEMORY_FACTOR` × the expected image
  below the point where the kernel starts throttling writers (:func:`page_cache_room`): those
  writes are memory copies too, measured faster than tmpfs's page allocation here, and hold no
  RAM once the staging is deleted; else memory when :func:`memory_headroom` covers that much;
  else disk.

The memory directory is ``/dev/shm/cairn-<run>``, or the work directory's own ``staging/``
when that is already on tmpfs (a memory-backed ``emptyDir``). Every function takes the
directories it looks at (and a ``root`` for ``/proc`` and ``/sys``) as arguments, so tests can
point them at a fake tree; the defaults are the real ones.
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from cairn.exceptions import ConfigError
from cairn.process.doctor import cgroup_memory, parse_meminfo, read_text
from cairn.process.snapshot import directory_bytes
from cairn.runtime.choices import coerce_option
from cairn.runtime.units import human_size

# Headroom a memory-staged dump needs, in images: the image itself plus a margin for what the
# workload allocates while the image waits for its ingest (issue 16).
MEMORY_FACTOR = 1.2
SHM_DIR = "/dev/shm"
MEMORY_FILESYSTEMS = frozenset({"tmpfs"})  # ramfs is left out: it has no size to bound a dump


class StagingMedium(str, enum.Enum):
    """Where ``cairn run`` stages a dump (``--staging``, ``CAIRN_STAGING``)."""

    AUTO = "auto"  # memory when the headroom covers 1.2 x the last image, else disk
    MEMORY = "memory"  # tmpfs: the shortest freeze; the image is charged to the memory cgroup
    DISK = "disk"  # the work directory: no RAM beyond the page cache

    @classmethod
    def parse(cls, value: object, *, source: str = "--staging") -> StagingMedium:
        """``value`` (a member or its text) as a member; ConfigError naming the choices."""
        return coerce_option(cls, value, source)  # type: ignore[no-any-return]


# -- how much memory a dump may take ----------------------------------------------------------

@dataclass(frozen=True)
class Headroom:
    """The memory a staged image may take, and what bounds it (None: no bound of that kind)."""

    cgroup_bytes: int | None  # the memory cgroup's limit less its working set
    available_bytes: int | None  # the host's MemAvailable
    tmpfs_free_bytes: int | None  # free space of the tmpfs the image would go to

    @property
    def bytes(self) -> int:
        bounds = [b for b in (self.cgroup_bytes, self.available_bytes, self.tmpfs_free_bytes)
                  if b is not None]
        return min(bounds) if bounds else 0

    @property
    def limited_by(self) -> str:
        named = (("the memory cgroup's limit", self.cgroup_bytes),
                 ("MemAvailable", self.available_bytes),
                 ("the tmpfs's free space", self.tmpfs_free_bytes))
        known = [(b, name) for name, b in named if b is not None]
        return min(known)[1] if known else "nothing readable"


def after_gpu_copy(headroom: Headroom, gpu_bytes: int) -> Headroom:
    """The memory left for a staged image once the driver has copied ``gpu_bytes`` of device
    memory into the workload: charged to the same cgroup and taken from MemAvailable (not from
    the tmpfs's own space), so a dump staged in memory needs room for both."""
    def less(value: int | None) -> int | None:
        return None if value is None else max(0, value - gpu_bytes)

    return dataclasses.replace(headroom, cgroup_bytes=less(headroom.cgroup_bytes),
                               available_bytes=less(headroom.available_bytes))


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _existing(path: str) -> str:
    """``path`` or its nearest existing ancestor (a directory may be made only at the dump)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def memory_headroom(tmpfs_dir: str | None = SHM_DIR, *, root: str = "/") -> Headroom:
    """How much more memory this process's memory cgroup and host can give, and the free
    space of the tmpfs at ``tmpfs_dir`` (None: not bounded by one).

    The cgroup is this process's (``/proc/self/cgroup``; v2 ``memory.max`` less the working set
    ``memory.current`` − ``inactive_file``, v1 ``memory.limit_in_bytes`` likewise): reclaimable
    page cache does not count, as the kubelet's eviction does not count it. ``max`` (no limit)
    leaves the host's ``MemAvailable``, which also bounds a limited cgroup (a host may be
    overcommitted). ``root`` prefixes ``/proc`` and ``/sys`` paths (tests give a fake tree).
    Unreadable parts are left out; nothing readable at all gives 0 bytes."""
    read = (lambda path: read_text(_under(root, path))) if root != "/" else read_text
    memory = cgroup_memory(read)
    meminfo = read("/proc/meminfo")
    available = parse_meminfo(meminfo).get("MemAvailable") if meminfo else None
    tmpfs_free = None
    if tmpfs_dir is not None:
        try:
            vfs = os.statvfs(_existing(tmpfs_dir))
            tmpfs_free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            tmpfs_free = 0  # nowhere to put it
    return Headroom(memory.headroom_bytes if memory is not None else None, available, tmpfs_free)


def memory_headroom_bytes(tmpfs_dir: str | None = SHM_DIR, *, root: str = "/") -> int:
    """The bytes a memory-backed staging directory at ``tmpfs_dir`` may take now: the least of
    the memory cgroup's headroom, ``MemAvailable`` and the tmpfs's free space (see
    :func:`memory_headroom`). Public: a restore's staging asks the same question."""
    return memory_headroom(tmpfs_dir, root=root).bytes


def _sysctl(read: Callable[[str], str | None], name: str) -> int:
    text = read(f"/proc/sys/vm/{name}")
    try:
        return int(text.strip()) if text else 0
    except ValueError:
        return 0


def page_cache_room(*, headroom: Headroom | None = None, root: str = "/") -> int | None:
    """How many more bytes a writer may dirty in a disk's page cache before the kernel
    throttles it (``balance_dirty_pages``' free-run point, halfway between the background and
    the hard dirty limits), less what is dirty or under writeback now; None when
    ``/proc/meminfo`` cannot be read. The limits are ``vm.dirty_bytes`` and
    ``vm.dirty_background_bytes``, or their ratios of the dirtyable memory (free plus file
    pages, bounded by the memory cgroup's headroom in ``headroom``, whose writeback is limited
    against its own memory)."""
    read = (lambda path: read_text(_under(root, path))) if root != "/" else read_text
    meminfo = read("/proc/meminfo")
    if not meminfo:
        return None
    info = parse_meminfo(meminfo)
    dirtyable = (info.get("MemFree", 0) + info.get("Active(file)", 0)
                 + info.get("Inactive(file)", 0))
    if headroom is not None and headroom.cgroup_bytes is not None:
        dirtyable = min(dirtyable, headroom.cgroup_bytes)
    limit = _sysctl(read, "dirty_bytes") or dirtyable * _sysctl(read, "dirty_ratio") // 100
    background = (_sysctl(read, "dirty_background_bytes")
                  or dirtyable * _sysctl(read, "dirty_background_ratio") // 100)
    dirty = info.get("Dirty", 0) + info.get("Writeback", 0)
    return max(0, (limit + background) // 2 - dirty)


# -- which filesystem a path is on ------------------------------------------------------------

def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes come octal-escaped."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: str, *, root: str = "/") -> str | None:
    """The type (``tmpfs``, ``ext4``...) of the mount holding ``path`` (which need not exist
    yet), from ``/proc/self/mountinfo``; None when it cannot be read."""
    text = read_text(_under(root, "/proc/self/mountinfo"))
    if text is None:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for line in text.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount = _unescape(fields[4])
        after = line.split(" - ", 1)[1].split()
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        # The last mount on a point wins (it hides those below), hence >=.
        if after and inside and len(mount) >= len(best):
            best, kind = mount, after[0]
    return kind


def on_memory(path: str, *, root: str = "/") -> bool:
    """Whether ``path`` lies on a memory-backed filesystem (tmpfs)."""
    return filesystem_type(path, root=root) in MEMORY_FILESYSTEMS


def memory_parent(run_dir: str, disk_parent: str, *, shm_dir: str = SHM_DIR,
                  root: str = "/") -> str:
    """Where a memory-staged dump of the run in ``run_dir`` goes: ``disk_parent`` itself when
    the run directory is already on tmpfs, else ``<shm_dir>/cairn-<run>`` (named after the run
    directory, so that the next run of the same key finds and removes what a killed one left
    in RAM)."""
    if on_memory(run_dir, root=root):
        return disk_parent
    return os.path.join(shm_dir, f"cairn-{os.path.basename(os.path.normpath(run_dir))}")


def prepare_private_dir(path: str) -> None:
    """Make ``path`` an empty directory only this user can enter (0700).

    One that exists must be a real directory owned by this user — a name in a world-writable
    ``/dev/shm`` may have been made by someone else, who must not get the workload's memory —
    and what it holds is a killed run's leftovers, removed (they hold RAM). Raises ConfigError
    naming the fix otherwise."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(f"cannot stage dumps in memory at {path}: it exists and is not a "
                          "directory of this user; remove it, or pass --staging disk")
    os.chmod(path, 0o700)
    for name in os.listdir(path):
        leftover = os.path.join(path, name)
        if os.path.isdir(leftover) and not os.path.islink(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            os.unlink(leftover)


def remove_private_dir(path: str) -> None:
    """Remove ``path`` if it is a directory of this user (what :func:`prepare_private_dir`
    made, or a killed run left) that no live run holds (:func:`hold_private_dir`); anything
    else there is not this run's to remove. Close this run's own hold first."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        _remove_unheld(path)


# A file in a held directory: the directory was made by a run that holds it while it lives,
# so once no process holds it, it is a killed run's and holds RAM for no one.
HELD_MARK = ".cairn-memory-staging"
_HOLD_TRIES = 20
_HOLD_RETRY_S = 0.05


def _open_dir(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_unheld(path: str) -> int | None:
    """Remove directory ``path`` unless a live process holds its lock; the bytes its files
    held, or None when it was held (or is gone)."""
    fd = _open_dir(path)
    if fd is None:
        return None
    try:
        if not _try_lock(fd):
            return None
        held = directory_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        return held
    finally:
        os.close(fd)


def hold_private_dir(path: str) -> int:
    """Make ``path`` this run's private directory (:func:`prepare_private_dir`) and hold it:
    an exclusive ``flock`` on the directory, taken before any leftover in it is removed, and
    :data:`HELD_MARK` written in it. Returns the descriptor that holds it: the hold ends when
    it is closed or when the process ends, however it ends (SIGKILL too), which is what lets
    :func:`remove_abandoned` tell a killed run's directory from a live one's. The descriptor
    is not inherited by children (CRIU, the workload). Raises ConfigError naming the fix when
    the path is not this user's directory, or another live run holds it."""
    for _ in range(_HOLD_TRIES):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # a sweep removed a killed run's directory of this name meanwhile
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            prepare_private_dir(path)  # raises the ConfigError that names the fix
        fd = _open_dir(path)
        if fd is None:
            continue  # removed, or replaced, since: look again
        if not _try_lock(fd):
            os.close(fd)
            time.sleep(_HOLD_RETRY_S)  # a sweep removing it, or a live run
            continue
        try:
            same = os.lstat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # a sweep removed the directory this descriptor is of
            os.close(fd)
            continue
        try:
            prepare_private_dir(path)
            os.close(os.open(HELD_MARK, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600,
                             dir_fd=fd))
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise ConfigError(f"cannot stage dumps in memory at {path}: another live cairn run holds "
                      "it (the same key and --workdir); pass --staging disk or give this run "
                      "its own --workdir")


def remove_abandoned(shm_dir: str = SHM_DIR, *, keep: str | None = None
                     ) -> list[tuple[str, int]]:
    """Remove every ``<shm_dir>/cairn-*`` directory of this user that a run held
    (:data:`HELD_MARK`) and no live process holds any more: the dumps a killed run (SIGKILL,
    the OOM killer) left in RAM, which would hold it until the next run of its own key, or
    the next boot. ``keep``: this run's own directory, never touched. Directories without the
    mark (another program's, or an older cairn's) are left alone. Returns (path, bytes) of
    each one removed."""
    removed: list[tuple[str, int]] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    mine = os.path.normpath(keep) if keep else None
    for name in names:
        path = os.path.join(shm_dir, name)
        if not name.startswith("cairn-") or os.path.normpath(path) == mine:
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            os.lstat(os.path.join(path, HELD_MARK))
        except OSError:
            continue
        held = _remove_unheld(path)
        if held is not None:
            removed.append((path, held))
    return removed


# -- the choice, per dump ---------------------------------------------------------------------

@dataclass(frozen=True)
class StagingChoice:
    """Where one dump stages: the directory its image directory is made in, on which medium
    (never AUTO), and why (one line for the log)."""

    parent: str
    medium: StagingMedium
    reason: str


def choose_staging(policy: StagingMedium, *, image_bytes: int | None, memory_dir: str,
                   disk_dir: str, estimate_bytes: int | None = None,
                   headroom: Headroom | None = None, page_cache: int | None = None,
                   root: str = "/") -> StagingChoice:
    """Where this dump stages under ``policy``. ``image_bytes``: what the last dump wrote (None
    before the first one, when ``estimate_bytes``, e.g. the workload's resident memory, stands
    in). ``memory_dir``/``disk_dir``: the two candidate parents. ``headroom`` and
    ``page_cache`` (AUTO only): measured now by :func:`memory_headroom` for ``memory_dir`` and
    :func:`page_cache_room` when not given."""
    policy = StagingMedium.parse(policy)
    if policy is StagingMedium.DISK:
        return StagingChoice(disk_dir, StagingMedium.DISK, "--staging disk")
    expected, what = ((image_bytes, "the last image") if image_bytes is not None
                      else (estimate_bytes, "the resident memory"))
    if headroom is None:
        headroom = memory_headroom(memory_dir, root=root)
    if policy is StagingMedium.AUTO and expected is not None:
        if page_cache is None:
            page_cache = page_cache_room(headroom=headroom, root=root)
        if page_cache is not None and page_cache >= MEMORY_FACTOR * expected:
            return StagingChoice(disk_dir, StagingMedium.DISK, (
                f"auto: the page cache takes {human_size(page_cache)} more before writeback "
                f"throttles, >= {MEMORY_FACTOR:g} x {what} {human_size(expected)}"))
    room = headroom.bytes
    if expected is None:
        fits, sizes = False, f"nothing to size the image by; headroom {human_size(room)}"
    else:
        fits = room >= MEMORY_FACTOR * expected
        sizes = (f"headroom {human_size(room)} (bounded by {headroom.limited_by}) "
                 f"{'>=' if fits else '<'} {MEMORY_FACTOR:g} x {what} {human_size(expected)}")
    if policy is StagingMedium.MEMORY:
        warning = "" if fits else "; the dump may fail for space or run the step out of memory"
        return StagingChoice(memory_dir, StagingMedium.MEMORY, f"--staging memory: {sizes}"
                             f"{warning}")
    if fits:
        return StagingChoice(memory_dir, StagingMedium.MEMORY,
                             f"auto: the page cache would throttle the dump; {sizes}")
    return StagingChoice(disk_dir, StagingMedium.DISK, f"auto: {sizes}")


__all__ = ["HELD_MARK", "MEMORY_FACTOR", "Headroom", "StagingChoice", "StagingMedium",
           "choose_staging", "filesystem_type", "hold_private_dir", "memory_headroom",
           "memory_headroom_bytes", "memory_parent", "on_memory", "page_cache_room",
           "prepare_private_dir", "remove_abandoned", "remove_private_dir"]
