"""A stand-in for a training process: counts upward, appending each value to a file every ~50 ms.

Each line goes out in one write(2) on an O_APPEND descriptor, so a checkpoint taken between
system calls never leaves half a line. Usage: ``python counter_child.py COUNTER_FILE``.
"""

from __future__ import annotations

import os
import sys
import time


def main(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n = 0
    while True:
        os.write(fd, f"{n}\n".encode())
        n += 1
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1])
