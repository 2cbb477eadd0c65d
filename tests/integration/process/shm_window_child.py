"""Stands still inside torch's shared-memory window: a /dev/shm/torch_* file created, sized,
mapped and held open but not yet unlinked, as a DataLoader worker holds it for an instant.
On SIGUSR1 it finishes as torch's allocator does (unlinks the file), checks the mapping reads
as zeros, writes into it and reports ``ok`` to its output file."""

from __future__ import annotations

import mmap
import os
import signal
import sys
import time

path, out = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 3 * mmap.PAGESIZE)
mapping = mmap.mmap(fd, 3 * mmap.PAGESIZE)
go = False


def proceed(*_: object) -> None:
    global go
    go = True


signal.signal(signal.SIGUSR1, proceed)
with open(out, "w") as f:
    f.write("ready\n")
while not go:
    time.sleep(0.01)
os.unlink(path)
zeros = mapping[:] == bytes(len(mapping))
mapping[:5] = b"batch"
with open(out, "a") as f:
    f.write(f"ok zeros={zeros} unlinked={not os.path.exists(path)}\n")
