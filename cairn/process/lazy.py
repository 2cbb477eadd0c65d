"""Lazy restore: the workload runs while the rest of its memory arrives (ADR 0021, 0026).

CRIU restores the process tree with ``--lazy-pages``: private anonymous memory (every page
its pagemap marks ``PE_LAZY``) is left unpopulated and registered with userfaultfd, and each
task's userfaultfd is handed over the ``lazy-pages.socket`` of the images directory to
cairn's own handler (:mod:`cairn.process.lazy_handler`, in place of ``criu lazy-pages``),
which fills it, on each page fault first and then in the background, until every page is
in. It copies a page only from a chunk of the snapshot that was read and verified (BLAKE3)
for that purpose, never from a file still being filled (:class:`PageSource`).

Everything else is fetched and verified before CRIU starts: the small images, and in every
``pages-*.img`` the pages CRIU restores itself (stacks, file-backed private memory: the
entries without ``PE_LAZY``). Shared memory and GPU state are never lazy (CRIU restores shmem
eagerly; a snapshot with GPU processes is restored eagerly by the supervisor).

A chunk that fails verification ends the restore: the restored tree is killed *before* the
handler closes its userfaultfds, because a process whose userfaultfd closes would read zeros
where its memory was (see :meth:`LazyRestore.fail`). The supervisor then restores the
previous snapshot; a failure of the reading on this side (a library error, a bug: a
:class:`~cairn.exceptions.RestoreFailed`, :mod:`cairn.store.verdicts`) ends the restore the
same way, but the supervisor then skips nothing and exits 8. No dump is taken while pages
are outstanding: the images of a half-filled process are not a snapshot (the supervisor polls
:meth:`LazyRestore.poll`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cairn.exceptions import CorruptSnapshot, CriuFailed, RestoreFailed
from cairn.process import criu as criu_mod
from cairn.process import uffd
from cairn.process.images import PAGE_SIZE, PE_LAZY, entries, fields, read_pagemap
from cairn.process.lazy_handler import FaultHandler, HandlerStats, Pending
from cairn.process.snapshot import IMAGES, process_info
from cairn.store import Manifest, Store
from cairn.store.fileops import pwrite_all
from cairn.store.manifest import ChunkRef
from cairn.store.reader import SnapshotReader
from cairn.store.verdicts import as_read_failure

log = logging.getLogger("cairn.run")

MM_MAGIC = 0x57492820  # mm-<pid>.img (criu/include/magic.h)
# The background fetch: FILL_THREADS steps of FILL_STEP_BYTES in flight (one ranged read
# each), so reading and hashing overlap on every core while a fault's own fetch goes first.
FILL_STEP_BYTES = 4 << 20
FILL_THREADS = 3
FILL_THREADS_DURING_FAULTS = 0  # fetchers that go on while faults fetch; the rest wait
FAULT_QUIET_S = 0.05
STOP_S = 10.0


def read_vma_bounds(path: str) -> list[int]:
    """Every VMA start and end of an ``mm-<pid>.img``, sorted (a copy stays inside one)."""
    messages = entries(path, magic=MM_MAGIC)
    bounds: set[int] = set()
    for number, value in fields(messages[0]) if messages else ():
        if number == 14 and isinstance(value, bytes):  # mm_entry.vmas
            vma = {n: v for n, v in fields(value) if n in (1, 2)}
            bounds.update(int(v) for v in vma.values())
    return sorted(bounds)


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
        self._bounds: dict[int, list[int]] = {}
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
            mm = os.path.join(image_dir, f"mm-{pid}.img")
            self._bounds[pid] = read_vma_bounds(mm) if os.path.exists(mm) else []

    def pids(self) -> list[int]:
        return sorted(self._runs)

    def eager_ranges(self) -> list[tuple[str, int, int]]:
        """``(pages image, offset, length)`` of every page CRIU restores itself."""
        return [(r.pages, r.offset, r.length) for runs in self._runs.values()
                for r in runs if not r.lazy]

    def lazy_segments(self, pid: int) -> Pending:
        """What the handler copies into ``pid``: its lazy runs, cut at the dumped VMA bounds
        (``UFFDIO_COPY`` fills one VMA at a time). Empty for a PID the snapshot lacks."""
        bounds = self._bounds.get(pid, [])
        out = []
        for run in self._runs.get(pid, []):
            if not run.lazy:
                continue
            start, end = run.vaddr, run.vaddr + run.length
            i = bisect.bisect_right(bounds, start)
            while i < len(bounds) and bounds[i] < end:
                out.append((start, bounds[i], start))
                start = bounds[i]
                i += 1
            out.append((start, end, start))
        return Pending(out)

    def locate(self, pid: int, vaddr: int, length: int) -> list[tuple[str, int, int]]:
        """The ``(pages image, offset, length)`` pieces holding ``length`` bytes at ``vaddr``
        of ``pid``. Raises CorruptSnapshot for an address the pagemap does not cover."""
        runs, starts = self._runs.get(pid), self._starts.get(pid)
        if runs is None or starts is None:
            raise CorruptSnapshot(f"the restored tree asked for pages of pid {pid}, "
                                  "which the snapshot does not hold")
        pieces = []
        while length > 0:
            i = bisect.bisect_right(starts, vaddr) - 1
            if i < 0 or vaddr >= runs[i].vaddr + runs[i].length:
                raise CorruptSnapshot(f"the restored tree asked for {vaddr:#x} of pid "
                                      f"{pid}, which no pagemap entry holds")
            run = runs[i]
            take = min(length, run.vaddr + run.length - vaddr)
            pieces.append((run.pages, run.offset + vaddr - run.vaddr, take))
            vaddr += take
            length -= take
        return pieces


_MISSING, _IN_FLIGHT, _VERIFIED = 0, 1, 2


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, size: int) -> int:
    """The address of a read-only shared mapping of ``size`` bytes of ``fd``."""
    address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of the lazy restore's scratch: {os.strerror(err)}")
    return int(address)


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
        # What UFFDIO_COPY reads from: the same page cache the verified chunks are written to.
        self.base = _map(self.fd, self.size) if self.size else 0

    def unmap(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.size)
            self.base = 0

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
        self._seq = manifest.seq
        self.on_progress: Callable[[], None] = lambda: None  # after each verified run
        self._cond = threading.Condition()
        self._files: dict[str, _ChunkFile] = {}
        self._failure: BaseException | None = None
        self.bytes_fetched = 0
        for name in names:
            entry = manifest.file(f"{IMAGES}/{name}")
            self._files[name] = _ChunkFile(os.path.join(image_dir, name), entry.chunks)
        self._cursor = [(name, 0) for name in names]  # where the background goes on
        self._urgent = 0  # faults fetching now
        self._last_urgent = 0.0  # when the last one was served
        self._closed = False

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
                self.on_progress()
        except BaseException as e:
            # Classified once, so that every waiter raises the same verdict or RestoreFailed.
            failure = as_read_failure(e, seq=self._seq)
            with self._cond:
                if self._failure is None:
                    self._failure = failure
                self._cond.notify_all()
            if failure is e:
                raise
            raise failure from e

    def ensure(self, name: str, offset: int, length: int, *, urgent: bool = False) -> None:
        """Block until ``[offset, offset + length)`` of pages image ``name`` is verified and
        in its scratch file. Raises CorruptSnapshot, or the error that ended a fetch as
        :func:`~cairn.store.verdicts.as_read_failure` classified it (RestoreFailed...).
        ``urgent``: a page fault waits for it; the background fetch makes room (see
        :meth:`fill_next`)."""
        if urgent:
            with self._cond:
                self._urgent += 1
        try:
            self._ensure(name, offset, length)
        finally:
            if urgent:
                with self._cond:
                    self._urgent -= 1
                    self._last_urgent = time.monotonic()
                    self._cond.notify_all()

    def _ensure(self, name: str, offset: int, length: int) -> None:
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
        # The failure as _fetch classified it: only a store verdict is a CorruptSnapshot.
        if self._failure is not None:
            raise self._failure

    def read(self, name: str, offset: int, length: int) -> bytes:
        """``length`` verified bytes at ``offset`` of pages image ``name``."""
        self.ensure(name, offset, length)
        data = os.pread(self._files[name].fd, length, offset)
        if len(data) != length:
            raise RestoreFailed(f"{name}: short read of the verified scratch copy (this side's "
                                "scratch, not the snapshot: nothing was skipped)", seq=self._seq)
        return data

    def address(self, name: str, offset: int) -> int:
        """Where byte ``offset`` of pages image ``name`` is mapped in this process (read it
        only after :meth:`ensure` of it returned)."""
        return self._files[name].base + offset

    def ready_prefix(self, name: str, offset: int, length: int) -> int:
        """How many bytes from ``offset`` (at most ``length``) are verified already."""
        file = self._files[name]
        if length <= 0:
            return 0
        with self._cond:
            end = offset
            for i in file.span(offset, length):
                if file.state[i] != _VERIFIED:
                    break
                end = file.offsets[i] + file.chunks[i].size
        return max(0, min(end, offset + length) - offset)

    @property
    def exhausted(self) -> bool:
        """Every chunk is claimed (verified, or being fetched by someone)."""
        with self._cond:
            return not self._cursor

    def fill_next(self, *, yield_to_faults: bool = False) -> bool:
        """Claim and fetch the next missing chunks (about FILL_STEP_BYTES) in image order;
        False when none is left to claim. Several threads may call it at once.

        ``yield_to_faults``: first wait while page faults are fetching, and until none came
        for FAULT_QUIET_S: a step that faults in its working set gets the disk and the cores
        (measured in ADR 0026)."""
        with self._cond:
            while yield_to_faults and self._failure is None and not self._closed:
                quiet = self._last_urgent + FAULT_QUIET_S - time.monotonic()
                if not self._urgent and quiet <= 0:
                    break
                self._cond.wait(max(quiet, 0.001) if not self._urgent else None)
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
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for file in self._files.values():
            file.unmap()
            with contextlib.suppress(OSError):
                os.close(file.fd)




@dataclass
class LazyStats:
    started: float
    restored_s: float = 0.0  # until criu restore returned: the workload runs from here
    resident_s: float | None = None  # until every page was in
    bytes_served: int = 0  # copied into the tree: on faults and in the background
    bytes_fetched: int = 0
    requests: int = 0  # page faults answered
    handler: HandlerStats | None = None


class LazyRestore:
    """One lazy restore in ``image_dir`` (whose small images, and the pages CRIU restores
    itself, are already fetched and verified), from :meth:`start` until :meth:`poll` is True.

    Owned by the thread that started it; the fault handler and the fetchers are its own
    threads."""

    def __init__(self, *, store: Store, manifest: Manifest, image_dir: str,
                 pages_names: Sequence[str], kill_tree: Callable[[int], None]) -> None:
        self.image_dir = image_dir
        self.index = PageIndex(image_dir)
        self.source = PageSource(store.reader(manifest), manifest, image_dir, pages_names)
        self._kill_tree = kill_tree
        self._seq = manifest.seq
        # CRIU restores the snapshot's PIDs exactly (they were free before it started).
        restoring = process_info(manifest).get("root_pid")
        self._restoring_root = restoring if isinstance(restoring, int) and restoring > 0 \
            else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._handler: FaultHandler | None = None
        self.failure: BaseException | None = None
        self.root_pid: int | None = None  # set before the background fetch starts
        self.stats = LazyStats(started=time.monotonic())
        for name, offset, length in self.index.eager_ranges():
            self.source.ensure(name, offset, length)

    def start(self, criu: str, *, pidfile: str, timeout: float | None = None) -> int:
        """Start the fault handler on ``lazy-pages.socket``, then ``criu restore
        --lazy-pages``; returns the restored root's PID (a child of the caller, as
        :func:`cairn.process.criu.restore`). Raises CriuFailed."""
        listener = uffd.HandoverListener(self.image_dir)
        handler = FaultHandler(listener, plan=self.index.lazy_segments,
                               locate=self.index.locate, source=self.source,
                               on_failure=self.fail)
        self._handler = handler
        self.source.on_progress = handler.wake
        thread = threading.Thread(target=handler.run, name="cairn-uffd", daemon=True)
        thread.start()
        self._threads.append(thread)
        try:
            pid = criu_mod.restore(criu, self.image_dir, pidfile=pidfile, timeout=timeout,
                                   extra=["--lazy-pages"])
        except BaseException as e:
            handler.stop()
            failure = self.failure  # why CRIU failed, when a page could not be served
            if isinstance(e, CriuFailed) and isinstance(failure, (CorruptSnapshot, RestoreFailed)):
                raise failure from failure.__cause__
            raise
        self.stats.restored_s = time.monotonic() - self.stats.started
        with self._lock:
            self.root_pid = pid
        if self.failure is not None:  # the handler failed while CRIU was restoring
            self.fail(self.failure)
        for n in range(FILL_THREADS):
            fill = threading.Thread(target=self._fill, args=(n >= FILL_THREADS_DURING_FAULTS,),
                                    name=f"cairn-lazy-fill-{n}", daemon=True)
            fill.start()
            self._threads.append(fill)
        return pid

    def _fill(self, yield_to_faults: bool) -> None:
        try:
            while not self._stop.is_set() and \
                    self.source.fill_next(yield_to_faults=yield_to_faults):
                pass
        except CorruptSnapshot as e:
            self.fail(e)
        except OSError as e:  # the scratch went away: the restore is being torn down
            if not self._stop.is_set():
                self.fail(e)
        except Exception as e:  # noqa: BLE001 - a RestoreFailed (or a bug): it ends the restore
            self.fail(as_read_failure(e, seq=self._seq))
        if self._handler is not None:
            self._handler.wake()

    def fail(self, error: BaseException) -> None:
        """End the restore: kill the restored tree first (its memory is incomplete and must
        never run on zeros), then stop the handler, which closes the userfaultfds. Safe from
        any thread, more than once."""
        with self._lock:
            if self.failure is None:
                self.failure = error
                log.error("lazy restore failed: %s; killing the restored workload", error)
            root = self.root_pid
        self._stop.set()
        if root is None:
            # CRIU is still restoring: start() kills the tree once it has its root. But a task
            # that faulted meanwhile waits for a page that will not come, and CRIU waits for
            # it: kill the tree being restored, so that CRIU fails instead of hanging.
            if self._restoring_root is not None:
                with contextlib.suppress(Exception):
                    self._kill_tree(self._restoring_root)
            return
        with contextlib.suppress(Exception):
            self._kill_tree(root)
        if self._handler is not None:
            self._handler.stop()

    def poll(self) -> bool:
        """Whether the restore has ended: every page in, or a failure (then
        :attr:`failure` is set and the tree is killed)."""
        handler = self._handler
        if handler is None:
            return True
        if not handler.done.is_set():
            return False
        if self.stats.resident_s is None:
            self.stats.resident_s = time.monotonic() - self.stats.started
            self.stats.bytes_served = handler.stats.fault_bytes + handler.stats.background_bytes
            self.stats.requests = handler.stats.faults
            self.stats.bytes_fetched = self.source.bytes_fetched
            self.stats.handler = handler.stats
            if not handler.complete and self.failure is None:
                self.fail(handler.error or CriuFailed("the lazy restore's handler stopped "
                                                      "before every page was in"))
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`poll` is True (True) or ``timeout`` seconds (False)."""
        handler = self._handler
        if handler is not None and not handler.done.wait(timeout):
            return False
        return self.poll()

    def close(self) -> None:
        """Stop the fetchers and the handler; the caller then removes the images."""
        self._stop.set()
        if self._handler is not None:
            self._handler.stop()
        for thread in self._threads:
            thread.join(timeout=STOP_S)
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
