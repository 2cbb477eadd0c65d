"""What a running workload holds, read from ``/proc``: its process tree, its open files and
sockets, whether it uses a GPU and how much memory it has.

These checks run before every dump so that a snapshot CRIU could not restore is refused with
a message naming the file or connection and the fix, rather than failing at restore time on
another node.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from cairn.runtime.env import CUDA_LIBRARY

O_ACCMODE = 0o3
O_APPEND = 0o2000

# Paths whose writes CRIU restores by itself or that are not files on a disk.
_NOT_DISK_FILES = ("/dev/", "/proc/", "/sys/", "pipe:", "socket:", "anon_inode:", "/memfd:")


@dataclass(frozen=True)
class OpenFile:
    pid: int
    fd: int
    target: str  # readlink of /proc/PID/fd/FD
    flags: int  # octal "flags:" of /proc/PID/fdinfo/FD

    @property
    def writable(self) -> bool:
        return self.flags & O_ACCMODE in (os.O_WRONLY, os.O_RDWR)

    @property
    def append(self) -> bool:
        return bool(self.flags & O_APPEND)

    @property
    def deleted(self) -> bool:
        return self.target.endswith(" (deleted)")

    @property
    def on_disk(self) -> bool:
        return self.target.startswith("/") and not self.target.startswith(_NOT_DISK_FILES)


@dataclass(frozen=True)
class Problem:
    """Something in the workload that a snapshot cannot carry; ``fix`` says what to change."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}"


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now (root first)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            parent = _ppid(int(name))
            if parent is not None:
                children.setdefault(parent, []).append(int(name))
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        if os.path.exists(f"/proc/{pid}"):
            tree.append(pid)
            stack.extend(sorted(children.get(pid, ()), reverse=True))
    return tree


def open_files(pids: list[int]) -> list[OpenFile]:
    """Every descriptor the processes hold (those that vanish while reading are skipped)."""
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
                with open(f"/proc/{pid}/fdinfo/{name}") as f:
                    info = f.read()
            except OSError:
                continue
            flags = next((int(line.split()[1], 8) for line in info.splitlines()
                          if line.startswith("flags:")), 0)
            out.append(OpenFile(pid=pid, fd=int(name), target=target, flags=flags))
    return out


def rewritten_files(files: list[OpenFile], *, ignore: set[str] = frozenset()) -> list[Problem]:
    """Regular files open for writing without ``O_APPEND``: CRIU records their size and refuses
    to restore once they changed after the snapshot, and cairn cannot cut them back."""
    problems = []
    seen: set[str] = set()
    for f in files:
        if (f.writable and not f.append and f.on_disk and not f.deleted
                and f.target not in ignore and f.target not in seen):
            seen.add(f.target)
            problems.append(Problem(
                what=f"pid {f.pid} holds {f.target} open for writing without append mode (fd "
                     f"{f.fd})",
                fix="open it with mode 'a' (append), or write it to a new file at the end of "
                    "the step; a file rewritten in place cannot be restored to its state at "
                    "the snapshot"))
    return problems


def append_files(files: list[OpenFile], *, ignore: set[str] = frozenset()) -> list[str]:
    """Paths of regular files open in append mode: cairn stores them with each snapshot, up to
    their size at the dump, and cuts them back to it before restore."""
    out: list[str] = []
    for f in files:
        if f.writable and f.append and f.on_disk and not f.deleted and f.target not in ignore:
            if f.target not in out:
                out.append(f.target)
    return out


def _socket_inodes(files: list[OpenFile]) -> dict[int, int]:
    inodes = {}
    for f in files:
        if f.target.startswith("socket:["):
            inodes[int(f.target[8:-1])] = f.pid
    return inodes


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(
            struct.pack(">I", struct.unpack("<I", raw[i:i + 4])[0]) for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def established_tcp(files: list[OpenFile]) -> list[Problem]:
    """Established TCP connections: CRIU would need ``--tcp-established`` and the peer to
    survive, which a retried step cannot promise, so they are refused by name."""
    inodes = _socket_inodes(files)
    if not inodes:
        return []
    problems = []
    for pid in sorted(set(inodes.values())):
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}") as f:
                    lines = f.read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                cols = line.split()
                if len(cols) < 10 or cols[3] != "01":  # 01: ESTABLISHED
                    continue
                inode = int(cols[9])
                if inode in inodes and inodes[inode] == pid:
                    problems.append(Problem(
                        what=f"pid {pid} has an established TCP connection "
                             f"{_address(cols[1])} -> {_address(cols[2])}",
                        fix="process snapshots cannot carry live connections (torchrun's "
                            "rendezvous store, wandb, a database client): run the script "
                            "without them (python train.py, WANDB_MODE=offline), or use "
                            "state mode (cairn.Checkpointer)"))
    return problems


def gpu_pids(pids: list[int], *, environ: Mapping[str, str] | None = None) -> list[int]:
    """Processes that may hold GPU state: they map an NVIDIA device (``/dev/nvidia*``) or the
    CUDA driver library (``CAIRN_CUDA_LIBRARY``'s file name; the tests' fake driver maps no
    device). The driver's ``cuCheckpointProcessGetState`` then says which hold a context."""
    library = os.path.basename(CUDA_LIBRARY.get(environ) or "libcuda.so.1")
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        if "/dev/nvidia" in maps or f"/{library}" in maps:
            out.append(pid)
    return out


def resident_bytes(pids: list[int]) -> int:
    """Resident memory of the processes (shared pages counted once per process)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total
