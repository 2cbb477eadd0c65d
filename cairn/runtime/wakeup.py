"""A wake-up flag that a signal handler may raise.

Python runs a signal handler in the main thread between two bytecodes, wherever that thread
happens to be — including inside ``threading.Event.wait()`` or ``clear()``, holding the
non-reentrant lock that ``Event.set()`` then waits for forever. So a handler must not call
``Event.set()`` (nor start a thread, nor take any lock the main thread may hold). Writing a
byte to a pipe takes no lock: the handler calls :meth:`Wakeup.set`, and whoever waits polls
the pipe.
"""

from __future__ import annotations

import math
import os
import select


class Wakeup:
    """A non-blocking pipe used as an event.

    :meth:`set` may be called from a signal handler or any thread; :meth:`wait` from one
    thread at a time. Both ends are close-on-exec, so children do not inherit them.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # close-on-exec (PEP 446)
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._closed = False
        # poll, not select: a process with a thousand open files gets descriptors select refuses.
        self._poller = select.poll()
        self._poller.register(self._read, select.POLLIN)

    def set(self, token: bytes = b"\0") -> None:
        """Wake the waiter; ``token`` (one byte) tells it why, where there is more than one
        reason."""
        if self._closed:
            return
        try:
            os.write(self._write, token)
        except OSError:
            pass  # a full pipe is already set; a closed one has nobody left to wake

    def wait(self, timeout: float | None) -> bytes:
        """Block until :meth:`set` was called (since the last wait) or ``timeout`` seconds
        pass. Returns the tokens set meanwhile, empty (false) on timeout; the flag is cleared
        on return."""
        if self._closed:
            return b""
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        if not self._poller.poll(ms):
            return b""
        tokens = bytearray()
        try:
            while chunk := os.read(self._read, 4096):
                tokens += chunk
        except OSError:  # BlockingIOError: empty now
            pass
        return bytes(tokens)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._read)
            os.close(self._write)

    def __enter__(self) -> Wakeup:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
