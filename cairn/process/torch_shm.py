"""Put back the shared-memory file a dump caught torch's allocator holding for an instant.

A DataLoader worker hands each batch to the trainer through a fresh ``/dev/shm/torch_<pid>_*``
file: torch's ``MapAllocator`` creates it (``shm_open``), sizes it, maps it and unlinks it,
all inside one constructor call and before any data is written. A dump that freezes the worker
inside that call records the file by its path, as an ordinary file; the worker unlinks it as
soon as it runs again, and ``criu restore`` then fails (``Can't open file dev/shm/torch_...``).

The file's whole content at that instant is zeros of its size at the dump, so recreating it
exactly is possible: :func:`recreate` makes each such file that is missing, zero-filled, at the
size CRIU recorded; the restored worker finishes the constructor and unlinks it. Only files
held open under torch's names are touched (``file_system`` sharing keeps files linked for
their whole life, with data, and maps them without holding them open: those are not put
back), and only those still linked at the dump: a file the worker had already unlinked is
a ghost CRIU restores itself under a name of its own, and a copy made at its old path would
be left in ``/dev/shm`` for good, as no one unlinks it again. The files made are sparse, but
the worker fills them: their sizes together must fit in the free space of ``/dev/shm``.
"""

from __future__ import annotations

import logging
import os
import re

from cairn.exceptions import RestoreFailed
from cairn.process.images import read_fd_file_ids, read_reg_files, read_unlinked_file_ids
from cairn.runtime.units import human_size

log = logging.getLogger(__name__)

_TORCH_SHM = re.compile(r"/?dev/shm/torch_[0-9_]+")


def recreate(image_dir: str | os.PathLike[str], *, root: str = "/") -> list[str]:
    """Create every missing torch shared-memory file the dump in ``image_dir`` holds open and
    had not unlinked, zero-filled at its dumped size (mode 0600, as torch makes it). Returns
    the paths made; remove them if the restore fails. Raises RestoreFailed, making nothing,
    when their sizes together exceed the free space of the ``/dev/shm`` they go to (a pod's
    may be smaller than the one the dump was taken on)."""
    held = read_fd_file_ids(image_dir)
    unlinked = read_unlinked_file_ids(image_dir)
    wanted = [(os.path.join(root, reg.name.lstrip("/")), reg.size or 0)
              for reg in read_reg_files(image_dir)
              if reg.id in held and reg.id not in unlinked and _TORCH_SHM.fullmatch(reg.name)]
    wanted = [(path, size) for path, size in wanted if not os.path.lexists(path)]
    if not wanted:
        return []
    shm = os.path.dirname(wanted[0][0])
    st = os.statvfs(shm)
    free = st.f_bavail * st.f_frsize
    total = sum(size for _, size in wanted)
    if total > free:
        raise RestoreFailed(
            f"the snapshot's DataLoader workers were creating {len(wanted)} shared-memory "
            f"file(s) of {human_size(total)} in {shm}, which has {human_size(free)} free: give "
            "the step a larger /dev/shm (on Kubernetes an emptyDir with medium Memory and a "
            "sizeLimit, mounted at /dev/shm)")
    made: list[str] = []
    for path, size in wanted:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        made.append(path)
        log.info("recreated %s (%d bytes): the dump caught a DataLoader worker creating it",
                 path, size)
    return made


def remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
