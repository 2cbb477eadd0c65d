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
back).
"""

from __future__ import annotations

import logging
import os
import re

from cairn.process.images import read_fd_file_ids, read_reg_files

log = logging.getLogger(__name__)

_TORCH_SHM = re.compile(r"/?dev/shm/torch_[0-9_]+")


def recreate(image_dir: str | os.PathLike[str], *, root: str = "/") -> list[str]:
    """Create every missing torch shared-memory file the dump in ``image_dir`` holds open,
    zero-filled at its dumped size (mode 0600, as torch makes it). Returns the paths made;
    remove them if the restore fails."""
    made: list[str] = []
    held = read_fd_file_ids(image_dir)
    for reg in read_reg_files(image_dir):
        if reg.id not in held or not _TORCH_SHM.fullmatch(reg.name):
            continue
        path = os.path.join(root, reg.name.lstrip("/"))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            os.ftruncate(fd, reg.size or 0)
        finally:
            os.close(fd)
        made.append(path)
        log.info("recreated %s (%d bytes): the dump caught a DataLoader worker creating it",
                 path, reg.size or 0)
    return made


def remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
