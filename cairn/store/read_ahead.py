"""Reading a stream of known length a window ahead of the writer, on a thread of its own.

A snapshot's writer adds a large file chunk by chunk: read, name (BLAKE3), look up, write
to a pack. On one thread those steps add up (a 2 GiB process image: ~3 s, ~0.4 s of it one
``readinto`` per 32 KiB chunk). :class:`ReadAhead` moves the reading to a thread of its own:
it reads whole windows of consecutive chunks with one ``readinto`` each, one window ahead of
the writer, which meets each chunk already in memory (ADR 0045). It does not name them: a
digest releases the GIL for every chunk and would wait to take it back behind the writer's
Python (ADR 0045 has the figures).

Contract: the windows are taken in order (iterating the ReadAhead) and each is given back
with :meth:`ReadAhead.release` once nothing reads its memory any more (the writer settles
its pack writer first: an encrypted store seals the last chunk asynchronously). Only the
ReadAhead's thread reads ``stream`` until the ReadAhead is closed. A failure of the thread
(an ``OSError`` reading the stream) is raised by the iteration, in the
caller's thread; a stream that ends early ends the iteration, and :attr:`ReadAhead.total`
says how many bytes it held. Closing (or leaving the ``with`` block) stops the thread and
waits for it, whatever the caller's state.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import TracebackType
from typing import IO, NamedTuple

# Big enough that a window costs one read syscall per ~128 chunks of 32 KiB; three of them
# (one being read, one waiting, one being written) keep each add at 12 MiB of memory.
WINDOW_BYTES = 4 << 20
WINDOWS = 3


class PlannedChunk(NamedTuple):
    """One chunk of the stream, in order: its length and its locator (or None)."""

    length: int
    locator: Hashable | None


class WindowChunk(NamedTuple):
    """A chunk in a window: where it lies in the window's memory, and its locator."""

    offset: int
    length: int
    locator: Hashable | None


class Window(NamedTuple):
    slot: int
    view: memoryview
    chunks: list[WindowChunk]


class _Failed(NamedTuple):
    error: BaseException


_DONE = object()


class ReadAhead:
    """Windows of ``plan``'s chunks read from ``stream`` with ``read`` (which fills a view
    and returns how many bytes it got; fewer only at the end of the stream). Module
    docstring. ``window_bytes`` is raised to the largest chunk when smaller."""

    def __init__(self, stream: IO[bytes], plan: Sequence[PlannedChunk], *,
                 window_bytes: int = WINDOW_BYTES,
                 windows: int = WINDOWS,
                 read: Callable[[IO[bytes], memoryview], int]) -> None:
        size = max([window_bytes, *(c.length for c in plan)])
        self._buffers = [memoryview(bytearray(size)) for _ in range(windows)]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(windows):
            self._free.put(slot)
        self._ready: queue.Queue[object] = queue.Queue()
        self._stop = threading.Event()
        self._stream, self._plan, self._read = stream, plan, read
        self.total = 0  # bytes read from the stream so far (final once the iteration ends)
        self._thread = threading.Thread(target=self._run, name="cairn-read-ahead",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            index, count = 0, len(self._plan)
            while index < count and not self._stop.is_set():
                slot = self._free.get()
                if self._stop.is_set():
                    break
                view = self._buffers[slot]
                end, span = index, 0
                while end < count and span + self._plan[end].length <= len(view):
                    span += self._plan[end].length
                    end += 1
                got = self._read(self._stream, view[:span])
                self.total += got
                chunks, at = [], 0
                for planned in self._plan[index:end]:
                    if at + planned.length > got:
                        break  # the stream ended early: only whole chunks are handed on
                    chunks.append(WindowChunk(at, planned.length, planned.locator))
                    at += planned.length
                self._ready.put(Window(slot, view, chunks))
                if got < span:
                    break
                index = end
        except BaseException as e:  # handed to the caller's thread, raised there
            self._ready.put(_Failed(e))
        finally:
            self._ready.put(_DONE)

    def __iter__(self) -> Iterator[Window]:
        while True:
            item = self._ready.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            assert isinstance(item, Window)
            yield item

    def release(self, window: Window) -> None:
        """Give ``window``'s memory back for the next read (nothing may read it any more)."""
        self._free.put(window.slot)

    def close(self) -> None:
        self._stop.set()
        self._free.put(0)  # wakes a thread waiting for a free window; it sees the stop
        self._thread.join()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
