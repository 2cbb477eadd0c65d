"""Lazy restore: the workload runs while the rest of its memory arrives (ADR 0021).

CRIU restores the process tree with ``--lazy-pages``: private anonymous memory (every page
its pagemap marks ``PE_LAZY``) is left unpopulated and registered with userfaultfd, and
``criu lazy-pages`` fills it, on each page fault first and then in the background, until
every page is in. The daemon takes its pages from a *page server* over CRIU's page-server
protocol; cairn is that server (:class:`PageServer`), and it serves a page only from a
chunk of the snapshot that was read and verified (BLAKE3) for that purpose, never from a
file still being filled (:class:`PageSource`).

Everything else is fetched and verified before CRIU starts: the small images, and in every
``pages-*.img`` the pages CRIU restores itself (stacks, file-backed private memory: the
entries without ``PE_LAZY``). Shared memory and GPU state are never lazy (CRIU restores shmem
eagerly; a snapshot with GPU processes is restored eagerly by the supervisor).

A chunk that fails verification ends the restore: the restored tree is killed *before* the
daemon is told to stop, because a process whose userfaultfd closes would read zeros where
its memory was (see :meth:`LazyRestore.fail`). The supervisor then restores the previous
snapshot. No dump is taken while pages are outstanding: the images of a half-filled process
are not a snapshot (the supervisor polls :meth:`LazyRestore.poll`).

The page-server protocol (CRIU 4.1.1 ``criu/page-xfer.c``): each message is
``struct page_server_iov { u32 cmd; u32 nr_pages; u64 vaddr; u64 dst_id; }``, little endian.
The daemon sends ``PS_IOV_GET`` for ``nr_pages`` at ``vaddr`` of process ``dst_id`` (its
PID as dumped, unlike the ``pid << 8 | type`` ids of a dump's messages); the server answers with the same header, ``cmd = PS_IOV_ADD_F | PE_PRESENT
<< 16``, followed by the pages. ``PS_IOV_CLOSE`` (or ``PS_IOV_FORCE_CLOSE``) ends the session
and is answered with an ``int32`` status of 0. The socket is one end of a loopback TCP pair
made here and handed to the daemon as ``--ps-socket``: nothing listens on a port.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cairn.exceptions import CorruptSnapshot, CriuFailed
from cairn.process import criu as criu_mod
from cairn.process.images import PAGE_SIZE, PE_LAZY, read_pagemap
from cairn.process.snapshot import IMAGES
from cairn.store import Manifest, Store
from cairn.store.fileops import pwrite_all
from cairn.store.manifest import ChunkRef
from cairn.store.reader import SnapshotReader

log = logging.getLogger("cairn.run")

PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
PE_PRESENT = 1 << 2
IOV = struct.Struct("<IIQQ")
LAZY_LOG = "lazy-pages.log"
DAEMON_SOCKET = "lazy-pages.socket"  # criu lazy-pages listens here, in the images directory
DAEMON_START_S = 30.0
# The background fetch: FILL_THREADS steps of FILL_STEP_BYTES in flight (one ranged read
# each), so reading and hashing overlap on every core while a fault's own fetch goes first.
FILL_STEP_BYTES = 4 << 20
FILL_THREADS = 3


@dataclass(frozen=True)
class _Run:
    """Pages ``[vaddr, vaddr + length)`` of one process lie at ``offset`` in ``pages``."""

    vaddr: int
    length: int
    pages: str
    offset: int
    lazy: bool


class PageIndex:
    """Where each dumped page of each process lies in the pages images, from the pagemaps."""

    def __init__(self, image_dir: str) -> None:
        self._runs: dict[int, list[_Run]] = {}
        self._starts: dict[int, list[int]] = {}
        for name in sorted(os.listdir(image_dir)):
            if not (name.startswith("pagemap-") and name.endswith(".img")):
                continue
            pid = int(name[len("pagemap-"):-len(".img")])
            pages_id, runs = read_pagemap(os.path.join(image_dir, name))
            offset, out = 0, []
            for run in runs:
                if not run.present:
                    continue
                length = run.nr_pages * PAGE_SIZE
                out.append(_Run(run.vaddr, length, f"pages-{pages_id}.img", offset,
                                bool(run.flags & PE_LAZY)))
                offset += length
            out.sort(key=lambda r: r.vaddr)
            self._runs[pid] = out
            self._starts[pid] = [r.vaddr for r in out]

    def pids(self) -> list[int]:
        return sorted(self._runs)

    def eager_ranges(self) -> list[tuple[str, int, int]]:
        """``(pages image, offset, length)`` of every page CRIU restores itself."""
        return [(r.pages, r.offset, r.length) for runs in self._runs.values()
                for r in runs if not r.lazy]

    def locate(self, pid: int, vaddr: int, length: int) -> list[tuple[str, int, int]]:
        """The ``(pages image, offset, length)`` pieces holding ``length`` bytes at ``vaddr``
        of ``pid``. Raises CorruptSnapshot for an address the pagemap does not cover."""
        runs, starts = self._runs.get(pid), self._starts.get(pid)
        if runs is None or starts is None:
            raise CorruptSnapshot(f"the lazy-pages daemon asked for pages of pid {pid}, "
                                  "which the snapshot does not hold")
        pieces = []
        while length > 0:
            i = bisect.bisect_right(starts, vaddr) - 1
            if i < 0 or vaddr >= runs[i].vaddr + runs[i].length:
                raise CorruptSnapshot(f"the lazy-pages daemon asked for {vaddr:#x} of pid "
                                      f"{pid}, which no pagemap entry holds")
            run = runs[i]
            take = min(length, run.vaddr + run.length - vaddr)
            pieces.append((run.pages, run.offset + vaddr - run.vaddr, take))
            vaddr += take
            length -= take
        return pieces


_MISSING, _IN_FLIGHT, _VERIFIED = 0, 1, 2


class _ChunkFile:
    """One pages image of the snapshot, fetched into ``path`` chunk by chunk. ``state`` is
    guarded by the owning :class:`PageSource`'s condition."""

    def __init__(self, path: str, chunks: Sequence[ChunkRef]) -> None:
        self.chunks = tuple(chunks)
        self.offsets: list[int] = []
        position = 0
        for chunk in self.chunks:
            self.offsets.append(position)
            position += chunk.size
        self.size = position
        self.state = [_MISSING] * len(self.chunks)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.fd, self.size)

    def span(self, offset: int, length: int) -> range:
        """Indices of the chunks covering ``[offset, offset + length)``."""
        first = bisect.bisect_right(self.offsets, offset) - 1
        last = bisect.bisect_right(self.offsets, offset + length - 1) - 1
        return range(max(first, 0), last + 1)


class PageSource:
    """The pages images of one snapshot, fetched on demand, each chunk verified before any
    of its bytes is written to the private scratch file it is served from.

    Thread-safe: the page server (a page fault) and the background fillers call
    :meth:`read` and :meth:`fill_next` concurrently. A chunk is fetched once: whoever needs
    it first claims it, others wait for it; claims and fetches run outside the lock, so a
    page fault's fetch never queues behind the background's."""

    def __init__(self, reader: SnapshotReader, manifest: Manifest, image_dir: str,
                 names: Sequence[str]) -> None:
        self._reader = reader
        self._cond = threading.Condition()
        self._files: dict[str, _ChunkFile] = {}
        self._failure: BaseException | None = None
        self.bytes_fetched = 0
        for name in names:
            entry = manifest.file(f"{IMAGES}/{name}")
            self._files[name] = _ChunkFile(os.path.join(image_dir, name), entry.chunks)
        self._cursor = [(name, 0) for name in names]  # where the background goes on

    def _claim(self, file: _ChunkFile, indices: range) -> list[tuple[int, int]]:
        """Mark the missing chunks of ``indices`` in flight; their runs ``(start, end)``.
        Called with the lock held."""
        runs: list[tuple[int, int]] = []
        for i in indices:
            if file.state[i] != _MISSING:
                continue
            file.state[i] = _IN_FLIGHT
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return runs

    def _fetch(self, file: _ChunkFile, runs: list[tuple[int, int]]) -> None:
        """Fetch, verify and write claimed runs, then mark them verified (or record the
        failure, which every waiter then raises)."""
        try:
            for start, end in runs:
                data = self._reader.read_chunks(file.chunks[start:end])  # raises if bad
                pwrite_all(file.fd, memoryview(data), file.offsets[start])
                with self._cond:
                    for i in range(start, end):
                        file.state[i] = _VERIFIED
                    self.bytes_fetched += len(data)
                    self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                if self._failure is None:
                    self._failure = e
                self._cond.notify_all()
            raise

    def ensure(self, name: str, offset: int, length: int) -> None:
        """Block until ``[offset, offset + length)`` of pages image ``name`` is verified and
        in its scratch file. Raises CorruptSnapshot (or the error that ended a fetch)."""
        file = self._files[name]
        if offset < 0 or length < 0 or offset + length > file.size:
            raise CorruptSnapshot(f"{name}: bytes {offset}..{offset + length} are outside "
                                  f"the image ({file.size} bytes)")
        if not length:
            return
        indices = file.span(offset, length)
        with self._cond:
            self._raise_failure()
            runs = self._claim(file, indices)
        if runs:
            self._fetch(file, runs)
        with self._cond:
            while not all(file.state[i] == _VERIFIED for i in indices):
                self._raise_failure()
                self._cond.wait()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            if isinstance(self._failure, CorruptSnapshot):
                raise self._failure
            raise CorruptSnapshot(f"fetching pages failed: {self._failure}") from self._failure

    def read(self, name: str, offset: int, length: int) -> bytes:
        """``length`` verified bytes at ``offset`` of pages image ``name``."""
        self.ensure(name, offset, length)
        data = os.pread(self._files[name].fd, length, offset)
        if len(data) != length:
            raise CorruptSnapshot(f"{name}: short read of the verified scratch copy")
        return data

    def fill_next(self) -> bool:
        """Claim and fetch the next missing chunks (about FILL_STEP_BYTES) in image order;
        False when none is left to claim. Several threads may call it at once."""
        with self._cond:
            self._raise_failure()
            while self._cursor:
                name, index = self._cursor[0]
                file = self._files[name]
                while index < len(file.chunks) and file.state[index] != _MISSING:
                    index += 1
                if index >= len(file.chunks):
                    self._cursor.pop(0)
                    continue
                end, size = index, 0
                while end < len(file.chunks) and size < FILL_STEP_BYTES and \
                        file.state[end] == _MISSING:
                    size += file.chunks[end].size
                    end += 1
                runs = self._claim(file, range(index, end))
                self._cursor[0] = (name, end)
                break
            else:
                return False
        self._fetch(file, runs)
        return True

    @property
    def complete(self) -> bool:
        with self._cond:
            return all(all(s == _VERIFIED for s in f.state) for f in self._files.values())

    def close(self) -> None:
        for file in self._files.values():
            with contextlib.suppress(OSError):
                os.close(file.fd)



def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None at a clean end of stream before the first byte."""
    parts, got = [], 0
    while got < size:
        piece = sock.recv(size - got)
        if not piece:
            if got == 0:
                return None
            raise ConnectionError("the lazy-pages daemon closed the socket mid-message")
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


class PageServer:
    """Answers the lazy-pages daemon's ``PS_IOV_GET`` requests from a :class:`PageSource`.
    :meth:`serve` runs on its own thread until the daemon closes the session."""

    def __init__(self, sock: socket.socket, source: PageSource, index: PageIndex, *,
                 on_corrupt: Callable[[CorruptSnapshot], None]) -> None:
        self._sock = sock
        self._source = source
        self._index = index
        self._on_corrupt = on_corrupt
        self.requests = 0
        self.bytes_served = 0
        self.error: BaseException | None = None
        self.closed_cleanly = False

    def serve(self) -> None:
        try:
            self._loop()
        except CorruptSnapshot as e:
            self.error = e
            self._on_corrupt(e)  # kills the tree before the daemon learns of the failure
        except (OSError, ConnectionError, ValueError) as e:
            self.error = e
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()

    def _loop(self) -> None:
        while True:
            header = _recv_exact(self._sock, IOV.size)
            if header is None:
                return
            cmd, nr_pages, vaddr, dst_id = IOV.unpack(header)
            if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self._sock.sendall(struct.pack("<i", 0))
                self.closed_cleanly = True
                return
            if cmd & ((1 << PS_CMD_BITS) - 1) != PS_IOV_GET:
                raise ValueError(f"unexpected page-server command {cmd:#x} from the daemon")
            pid = dst_id  # a GET names the process by its PID, not encoded (uffd.c)
            pieces = self._index.locate(pid, vaddr, nr_pages * PAGE_SIZE)
            data = b"".join(self._source.read(name, offset, length)
                            for name, offset, length in pieces)
            reply = IOV.pack(PS_IOV_ADD_F | (PE_PRESENT << PS_CMD_BITS), nr_pages, vaddr, dst_id)
            self._sock.sendall(reply + data)
            self.requests += 1
            self.bytes_served += len(data)


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair (CRIU sets TCP options on the page-server socket). The
    listener accepts one connection and only from the socket made here."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, peer = listener.accept()
        # Each reply is one page fault's wait: never held back for a fuller segment (Nagle).
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if peer != client.getsockname():
            client.close()
            server.close()
            raise CriuFailed("another process connected to the lazy restore's page server "
                             "socket before cairn did; try again")
    return server, client


@dataclass
class LazyStats:
    started: float
    restored_s: float = 0.0  # until criu restore returned: the workload runs from here
    resident_s: float | None = None  # until the daemon had put every page in
    bytes_served: int = 0
    bytes_fetched: int = 0
    requests: int = 0


class LazyRestore:
    """One lazy restore in ``image_dir`` (whose small images, and the pages CRIU restores
    itself, are already fetched and verified), from :meth:`start` until :attr:`done`.

    Owned by the thread that started it; the page server and the filler are its own threads.
    """

    def __init__(self, *, store: Store, manifest: Manifest, image_dir: str,
                 pages_names: Sequence[str], kill_tree: Callable[[int], None]) -> None:
        self.image_dir = image_dir
        self.index = PageIndex(image_dir)
        self.source = PageSource(store.reader(manifest), manifest, image_dir, pages_names)
        self._kill_tree = kill_tree
        self._stop = threading.Event()
        self._daemon: subprocess.Popen[bytes] | None = None
        self._daemon_status: int | None = None
        self._threads: list[threading.Thread] = []
        self._server: PageServer | None = None
        self.failure: BaseException | None = None
        self.root_pid: int | None = None  # set before the background fetch starts
        self.stats = LazyStats(started=time.monotonic())
        for name, offset, length in self.index.eager_ranges():
            self.source.ensure(name, offset, length)

    def start(self, criu: str, *, pidfile: str, timeout: float | None = None) -> int:
        """Start the page server and ``criu lazy-pages``, then ``criu restore --lazy-pages``;
        returns the restored root's PID (a child of the caller, as
        :func:`cairn.process.criu.restore`). Raises CriuFailed."""
        server_sock, daemon_sock = _socket_pair()
        self._server = PageServer(server_sock, self.source, self.index,
                                  on_corrupt=self.fail)
        serve = threading.Thread(target=self._server.serve, name="cairn-page-server",
                                 daemon=True)
        serve.start()
        self._threads.append(serve)
        argv = [criu, "lazy-pages", "-D", self.image_dir, "-o", LAZY_LOG, "--page-server",
                "--ps-socket", str(daemon_sock.fileno())]
        try:
            self._daemon = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL,
                                            pass_fds=(daemon_sock.fileno(),),
                                            preexec_fn=criu_mod.set_parent_death_kill)
        finally:
            daemon_sock.close()
        self._wait_for_daemon_socket()
        pid = criu_mod.restore(criu, self.image_dir, pidfile=pidfile, timeout=timeout,
                               extra=["--lazy-pages"])
        self.stats.restored_s = time.monotonic() - self.stats.started
        self.root_pid = pid
        if self.failure is not None:  # the server failed while CRIU was restoring
            self.fail(self.failure)
        for n in range(FILL_THREADS):
            fill = threading.Thread(target=self._fill, name=f"cairn-lazy-fill-{n}", daemon=True)
            fill.start()
            self._threads.append(fill)
        return pid

    def _wait_for_daemon_socket(self) -> None:
        path = os.path.join(self.image_dir, DAEMON_SOCKET)
        deadline = time.monotonic() + DAEMON_START_S
        while not os.path.exists(path):
            assert self._daemon is not None
            if self._daemon.poll() is not None:
                raise CriuFailed("criu lazy-pages exited before it was ready "
                                 f"(exit {self._daemon.returncode}):\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise CriuFailed(f"criu lazy-pages did not start within {DAEMON_START_S:.0f}s")
            time.sleep(0.005)

    def _log_tail(self) -> str:
        return criu_mod.log_tail(os.path.join(self.image_dir, LAZY_LOG))

    def _fill(self) -> None:
        try:
            while not self._stop.is_set() and self.source.fill_next():
                pass
        except CorruptSnapshot as e:
            self.fail(e)
        except OSError as e:  # the scratch went away: the restore is being torn down
            if not self._stop.is_set():
                self.fail(e)

    def fail(self, error: BaseException) -> None:
        """End the restore: kill the restored tree first (its memory is incomplete and must
        never run on zeros), then the daemon. Safe from any thread, more than once."""
        if self.failure is None:
            self.failure = error
            log.error("lazy restore failed: %s; killing the restored workload", error)
        self._stop.set()
        if self.root_pid is not None:
            with contextlib.suppress(Exception):
                self._kill_tree(self.root_pid)
        if self._daemon is not None and self._daemon.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._daemon.kill()

    def reaped(self, pid: int, status: int) -> bool:
        """Tell the restore that the caller reaped ``pid`` (a ``waitpid(-1)`` loop takes the
        daemon's status too); True when it was the daemon."""
        if self._daemon is None or pid != self._daemon.pid:
            return False
        self._daemon_status = status
        self._daemon.returncode = os.waitstatus_to_exitcode(status)
        return True

    def poll(self) -> bool:
        """Whether the daemon has ended: every page delivered, or a failure (then
        :attr:`failure` is set and the tree is killed)."""
        if self._daemon is None:
            return True
        if self._daemon.returncode is None:
            try:
                if self._daemon.poll() is None:
                    return False
            except ChildProcessError:
                pass
        if self.stats.resident_s is None:
            self.stats.resident_s = time.monotonic() - self.stats.started
            self._finish_stats()
            code = self._daemon.returncode
            server = self._server
            if code != 0 or (server is not None and server.error is not None):
                reason = (server.error if server is not None and server.error is not None
                          else CriuFailed(f"criu lazy-pages exited {code}:\n{self._log_tail()}"))
                self.fail(reason)
        return True

    def _finish_stats(self) -> None:
        if self._server is not None:
            self.stats.bytes_served = self._server.bytes_served
            self.stats.requests = self._server.requests
        self.stats.bytes_fetched = self.source.bytes_fetched

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until :attr:`done` (True) or ``timeout`` seconds (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the filler, the daemon and the server; the caller then removes the images."""
        self._stop.set()
        if self._daemon is not None and self._daemon.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._daemon.kill()
            with contextlib.suppress(Exception):
                self._daemon.wait(timeout=10)
        for thread in self._threads:
            thread.join(timeout=10)
        self.source.close()


def pages_names(manifest: Manifest) -> list[str]:
    """The pages images of a process snapshot (what a lazy restore fetches on demand)."""
    prefix = f"{IMAGES}/"
    out = []
    for entry in manifest.files:
        name = entry.path[len(prefix):] if entry.path.startswith(prefix) else ""
        if name.startswith("pages-") and name.endswith(".img") and "/" not in name:
            out.append(name)
    return out
