"""cairn's userfaultfd handler: fills a lazily restored tree's memory (ADR 0026).

It takes the place of ``criu lazy-pages``: it listens on the socket ``criu restore
--lazy-pages`` hands each task's userfaultfd to (:mod:`cairn.process.uffd`) and, on one
thread, answers every page fault with one ``UFFDIO_COPY`` of up to :data:`FAULT_AROUND`
bytes around the fault (within the pagemap entry and the VMA, from verified chunks only:
:class:`Source.ensure` fetches and verifies what is missing first), then copies the rest in
steps of :data:`STEP` as the background fetch verifies it. Every copy, event and fault is
handled on that one thread, in the order the kernel queued them, so a ``REMOVE`` or ``UNMAP``
is applied before any later copy could put old pages back into the removed range.

Events, as CRIU's daemon handles them: ``REMOVE``/``UNMAP`` drop the range from what is still
to be copied (a later fault there gets a zero page, what ``MADV_DONTNEED`` means for private
anonymous memory); ``REMAP`` moves it; ``FORK`` adds the child (its own descriptor, the
parent's pages still to copy, from the same pages). A fault on a page that is not waiting
for a copy (a page the dump did not hold, or one a racing thread already got) is answered
with a zero page; ``EEXIST`` there just wakes the thread.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from cairn.process import uffd
from cairn.process.images import PAGE_SIZE

FAULT_AROUND = 1 << 20  # a fault copies the aligned 1 MiB around it (ADR 0026)
STEP = 4 << 20  # the background's copies, as large as the fetch's steps
IDLE_POLL_S = 0.05  # a wake-up check while the background waits for the fetch

Segment = tuple[int, int, int]  # [start, end) of the process now, from src as dumped


class Pending:
    """Address ranges of one process still waiting for their pages: sorted, disjoint
    ``(start, end, src)``, ``src`` being where those pages were when dumped (they differ
    after a ``REMAP``). Not thread-safe (the handler's thread owns it)."""

    def __init__(self, segments: Iterable[Segment] = ()) -> None:
        self._segs: list[Segment] = sorted(s for s in segments if s[1] > s[0])
        self._starts = [s[0] for s in self._segs]

    def __bool__(self) -> bool:
        return bool(self._segs)

    def __iter__(self):  # noqa: ANN204 - Iterator[Segment]
        return iter(list(self._segs))

    @property
    def bytes(self) -> int:
        return sum(e - s for s, e, _ in self._segs)

    def copy(self) -> Pending:
        return Pending(self._segs)

    def find(self, addr: int) -> Segment | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._segs[i][1]:
            return self._segs[i]
        return None

    def first(self) -> Segment | None:
        return self._segs[0] if self._segs else None

    def take(self, start: int, end: int) -> list[Segment]:
        """Remove ``[start, end)`` and return the pieces of it that were pending."""
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        j = i
        keep: list[Segment] = []
        taken: list[Segment] = []
        while j < len(self._segs) and self._segs[j][0] < end:
            s, e, src = self._segs[j]
            if e <= start:
                keep.append((s, e, src))
            else:
                if s < start:
                    keep.append((s, start, src))
                lo, hi = max(s, start), min(e, end)
                taken.append((lo, hi, src + lo - s))
                if e > end:
                    keep.append((end, e, src + end - s))
            j += 1
        if taken:
            self._segs[i:j] = keep
            self._starts[i:j] = [s[0] for s in keep]
        return taken

    def put(self, segments: Iterable[Segment]) -> None:
        """Add ranges back (they must not overlap what is pending)."""
        for seg in segments:
            if seg[1] > seg[0]:
                i = bisect.bisect_left(self._starts, seg[0])
                self._segs.insert(i, seg)
                self._starts.insert(i, seg[0])

    def remap(self, old: int, new: int, length: int) -> None:
        moved = self.take(old, old + length)
        self.take(new, new + length)  # mremap replaced whatever was mapped there
        self.put((s - old + new, e - old + new, src) for s, e, src in moved)


class Source(Protocol):
    """Verified pages, where the handler copies from (:class:`cairn.process.lazy.PageSource`)."""

    def ensure(self, name: str, offset: int, length: int, *, urgent: bool = False) -> None: ...
    def ready_prefix(self, name: str, offset: int, length: int) -> int: ...
    def address(self, name: str, offset: int) -> int: ...
    @property
    def exhausted(self) -> bool: ...


Locate = Callable[[int, int, int], list[tuple[str, int, int]]]


@dataclass
class Target:
    """One restored process: its userfaultfd, the PID whose pages it holds (its own, or its
    parent's for a child forked during the lazy phase) and what is still to copy."""

    fd: int
    pid: int
    pending: Pending
    alive: bool = True


@dataclass
class HandlerStats:
    faults: int = 0
    fault_bytes: int = 0
    background_bytes: int = 0
    zero_pages: int = 0
    forks: int = 0
    remaps: int = 0
    removes: int = 0
    fault_fetch_s: float = 0.0  # faults waiting for verified pages
    fault_copy_s: float = 0.0  # faults' UFFDIO_COPYs


class FaultHandler:
    """The handler of one lazy restore. :meth:`run` on its own thread until every page is in,
    :meth:`stop` is called, or a failure: then ``on_failure`` runs on the handler's thread
    and the userfaultfds stay open until :meth:`stop` (call it once the tree is dead)."""

    def __init__(self, listener: uffd.HandoverListener, *, plan: Callable[[int], Pending],
                 locate: Locate, source: Source,
                 on_failure: Callable[[BaseException], None],
                 fault_around: int = FAULT_AROUND, step: int = STEP) -> None:
        self._listener = listener
        self._plan = plan
        self._locate = locate
        self._source = source
        self._on_failure = on_failure
        self._fault_around = fault_around
        self._step = step
        self._targets: dict[int, Target] = {}
        self._retry: list[tuple[Target, int]] = []
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._epoll = select.epoll()
        self._conn_fd: int | None = None
        self.restore_finished = False
        self.done = threading.Event()  # set when run() returns
        self.complete = False  # every page in, nothing failed
        self.error: BaseException | None = None
        self.stats = HandlerStats()
        self.pids: list[int] = []

    # -- from other threads --

    def wake(self) -> None:
        """Something the handler waits for happened (the fetch verified more pages)."""
        with self._wake_lock:  # never write to the number once closed: it may be reused
            if self._wake_fd >= 0:
                with contextlib.suppress(OSError):
                    os.eventfd_write(self._wake_fd, 1)

    def stop(self) -> None:
        self._stop.set()
        self.wake()

    # -- the handler's thread --

    def run(self) -> None:
        try:
            self._epoll.register(self._listener.fileno(), select.EPOLLIN)
            self._epoll.register(self._wake_fd, select.EPOLLIN)
            self._loop()
        except BaseException as e:  # noqa: BLE001 - every failure ends the restore the same way
            if not self._stop.is_set():
                self.error = e
                self._on_failure(e)  # kills the tree: nothing may run on zero pages
                self._stop.wait()  # the descriptors close only once the tree is dead
        finally:
            for target in self._targets.values():
                with contextlib.suppress(OSError):
                    os.close(target.fd)
            self._targets.clear()
            self._epoll.close()
            with self._wake_lock:
                os.close(self._wake_fd)
                self._wake_fd = -1
            self._listener.close()
            self.done.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._retry) or self._background_ready()
            events = self._epoll.poll(0 if busy else IDLE_POLL_S)
            for fd, _ in events:
                self._dispatch(fd)
                if self._stop.is_set():
                    return
            retry, self._retry = self._retry, []
            for target, address in retry:
                if target.alive:
                    self._fault(target, address)
            if self.restore_finished:
                if not any(t.alive and t.pending for t in self._targets.values()):
                    self.complete = True
                    return
                self._background()

    def _dispatch(self, fd: int) -> None:
        if fd == self._wake_fd:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)
        elif fd == self._listener.fileno():
            conn = self._listener.accept()
            self._conn_fd = conn.fileno()
            self._epoll.unregister(fd)
            self._epoll.register(self._conn_fd, select.EPOLLIN)
        elif fd == self._conn_fd:
            kind, pid, ufd = self._listener.receive()
            if kind == "uffd" and ufd is not None:
                self._add(Target(ufd, pid, self._plan(pid)))
                self.pids.append(pid)
            elif kind in ("finished", "closed"):
                self._epoll.unregister(fd)
                self._conn_fd = None
                if kind == "closed" and not self.restore_finished:
                    raise ConnectionError("criu restore closed the lazy-pages socket before "
                                          "the restore finished")
                self.restore_finished = True
        else:
            target = self._targets.get(fd)
            if target is not None:
                self._drain(target)

    def _add(self, target: Target) -> None:
        self._targets[target.fd] = target
        self._epoll.register(target.fd, select.EPOLLIN)

    def _drop(self, target: Target) -> None:
        target.alive = False
        self._targets.pop(target.fd, None)
        with contextlib.suppress(OSError):
            self._epoll.unregister(target.fd)
        with contextlib.suppress(OSError):
            os.close(target.fd)

    def _drain(self, target: Target) -> None:
        """Handle every message queued on ``target``'s descriptor, in order."""
        while target.alive:
            events = uffd.read_events(target.fd)
            if events is None:
                self._drop(target)
                return
            if not events:
                return
            for event in events:
                self._event(target, event)

    def _event(self, target: Target, event: uffd.Event) -> None:
        if event.kind == uffd.EVENT_PAGEFAULT:
            self._fault(target, event.a)
        elif event.kind in (uffd.EVENT_REMOVE, uffd.EVENT_UNMAP):
            self.stats.removes += 1
            target.pending.take(event.a, event.b)
        elif event.kind == uffd.EVENT_REMAP:
            self.stats.remaps += 1
            target.pending.remap(event.a, event.b, event.c)
        elif event.kind == uffd.EVENT_FORK:
            self.stats.forks += 1
            self._add(Target(event.a, target.pid, target.pending.copy()))
        else:
            raise OSError(errno.EPROTO, f"unexpected userfaultfd event {event.kind:#x}")

    def _fault(self, target: Target, address: int) -> None:
        page = address & ~(PAGE_SIZE - 1)
        seg = target.pending.find(page)
        self.stats.faults += 1
        if seg is None:
            err = uffd.zeropage(target.fd, page, PAGE_SIZE)
            if err == 0:
                self.stats.zero_pages += 1
            elif err == errno.EAGAIN:
                self._retry.append((target, address))
            elif err in (errno.ESRCH, errno.ENOSPC):
                self._drop(target)
            else:  # EEXIST: another thread's fault filled it; ENOENT: no longer mapped
                uffd.wake(target.fd, page, PAGE_SIZE)
            return
        window = page & ~(self._fault_around - 1)
        lo, hi = max(seg[0], window), min(seg[1], window + self._fault_around)
        copied = self._copy(target, lo, hi, urgent=True)
        self.stats.fault_bytes += copied
        if target.alive and target.pending.find(page) is not None:
            self._retry.append((target, address))  # the mapping changed under the copy

    def _copy(self, target: Target, start: int, end: int, *, urgent: bool = False) -> int:
        """Copy pending ``[start, end)`` into ``target`` from verified pages (fetched first
        where missing); bytes copied. What a changing mapping interrupts goes back to pending."""
        pieces = target.pending.take(start, end)
        total = 0
        for k, (s, e, src) in enumerate(pieces):
            pos = s
            for name, offset, length in self._locate(target.pid, src, e - s):
                t0 = time.monotonic()
                self._source.ensure(name, offset, length, urgent=urgent)
                t1 = time.monotonic()
                stopped = self._copy_run(target, pos, self._source.address(name, offset),
                                         length)
                if urgent:
                    self.stats.fault_fetch_s += t1 - t0
                    self.stats.fault_copy_s += time.monotonic() - t1
                if not target.alive:
                    return total
                if stopped is not None:
                    total += stopped - pos
                    if target.alive:
                        target.pending.put([(stopped, e, src + stopped - s), *pieces[k + 1:]])
                    return total
                total += length
                pos += length
        return total

    def _copy_run(self, target: Target, dst: int, src: int, length: int) -> int | None:
        """One contiguous copy; None when done, or where ``EAGAIN`` stopped it."""
        end, pos, pagewise = dst + length, dst, False
        while pos < end:
            n = PAGE_SIZE if pagewise else end - pos
            done, err = uffd.copy(target.fd, pos, src + pos - dst, n)
            pos += done
            if err == 0:
                continue
            if err == errno.EEXIST:
                pos += PAGE_SIZE  # already in (a page another copy or fault put there)
            elif err == errno.EAGAIN:
                if done == 0:
                    return pos  # an event is queued: read it before copying on
            elif err == errno.ENOENT:
                if pagewise:
                    pos += PAGE_SIZE  # not mapped any more
                pagewise = True  # the range spans VMAs the workload split since
            elif err in (errno.ESRCH, errno.ENOSPC):
                self._drop(target)  # the process is gone
                return None
            else:
                raise OSError(err, f"UFFDIO_COPY at {pos:#x}: {os.strerror(err)}")
        return None

    def _background_ready(self) -> bool:
        if not self.restore_finished:
            return False
        return any(self._head_ready(t) for t in self._targets.values() if t.alive)

    def _head_ready(self, target: Target) -> int:
        """Verified bytes at the head of ``target``'s pending (up to a step)."""
        head = target.pending.first()
        if head is None:
            return 0
        s, e, src = head
        ready = 0
        for name, offset, length in self._locate(target.pid, src, min(e - s, self._step)):
            got = self._source.ready_prefix(name, offset, length)
            ready += got
            if got < length:
                break
        return ready - ready % PAGE_SIZE

    def _background(self) -> None:
        """One step for each process whose next pages are verified; once the fetch has
        claimed everything, wait for (or fetch) what is still missing."""
        for target in list(self._targets.values()):
            if not target.alive:
                continue
            ready = self._head_ready(target)
            head = target.pending.first()
            if head is None:
                continue
            if not ready and self._source.exhausted:
                ready = min(head[1] - head[0], self._step)
            if ready:
                self.stats.background_bytes += self._copy(target, head[0], head[0] + ready)

