"""What every bench script needs from the machine: the page cache, the load, durable files.

Imported by the bench scripts as ``benchenv`` (``bench/`` is on ``sys.path`` when a script in
it runs).
"""

from __future__ import annotations

import os
import shutil


def drop_caches() -> bool:
    """``sync`` then drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def fsync_path(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove a file or a tree, if it is there."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)
