"""A link with a cloud's manners, on loopback: a TCP proxy that adds latency, caps each
connection's bandwidth, and injects connection resets, stalls and HTTP 429/503 answers
(issue 34; this kernel has no ``netem``).

    with LinkProxy(("127.0.0.1", server_port), rtt_s=0.03, rate=20 << 20,
                   faults=Faults(status_every=7)) as link:
        client_talks_to(f"http://127.0.0.1:{link.port}")
        print(link.stats)

Each accepted connection gets one to the target. Bytes in either direction arrive one way's
delay (``rtt_s / 2``) after they were read, in order, so a stream pipelines as over a long
link instead of paying the delay per read; ``rate`` (bytes per second, per connection and per
direction) paces them. Faults, each counted in :attr:`LinkProxy.stats`:

* ``status_every=N``: every N-th HTTP request (counted over all connections) is answered by
  the proxy itself with ``status`` (503, or 429 with ``Retry-After``) and never reaches the
  server. Requests are framed by ``Content-Length`` or chunked transfer coding, HTTP/1.1
  without pipelining, as every client here sends them;
* ``reset_every_bytes=B``: a connection is reset (RST: ``SO_LINGER`` 0) once B more bytes
  went from the server to the client over all connections, mid-response;
* ``stall_every_bytes=B``, ``stall_s``: once B more bytes went to the client, the link
  stops delivering for ``stall_s`` seconds (both directions of that connection);
* ``drop_request_headers``: those headers are removed from every request (a server that
  ignores them, as an S3-compatible endpoint without conditional writes ignores
  ``If-None-Match``).

The proxy runs an asyncio loop on a thread of its own; every method may be called from any
thread. It is a stand-in for the network only: the server behind it is a real one.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_READ = 256 << 10
_PIECE = 64 << 10  # what the link paces as one
_MAX_HEAD = 64 << 10


@dataclass(frozen=True)
class Faults:
    """What the link does wrong (module docstring); the default: nothing."""

    status_every: int | None = None
    status: int = 503
    reset_every_bytes: int | None = None
    stall_every_bytes: int | None = None
    stall_s: float = 1.0
    #: Request headers removed on the way (lower-case names): an endpoint that ignores them.
    drop_request_headers: tuple[str, ...] = ()


@dataclass
class LinkStats:
    connections: int = 0
    requests: int = 0
    statuses: int = 0
    resets: int = 0
    stalls: int = 0
    to_server: int = 0
    to_client: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: getattr(self, name) for name in (
                "connections", "requests", "statuses", "resets", "stalls", "to_server",
                "to_client")}


class _Pacer:
    """Delivers pieces ``delay`` after they were read, at most ``rate`` bytes a second."""

    def __init__(self, writer: asyncio.StreamWriter, *, delay: float, rate: float | None,
                 stalled: Callable[[], float]) -> None:
        self._writer = writer
        self._delay = delay
        self._rate = rate
        self._stalled = stalled
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._next_free = 0.0
        self.task = asyncio.ensure_future(self._run())

    def send(self, data: bytes) -> None:
        due = time.monotonic() + self._delay
        for start in range(0, len(data), _PIECE):  # a 32 MiB request is paced, not one burst
            self._queue.put_nowait((due, data[start:start + _PIECE]))

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def _run(self) -> None:
        try:
            while (item := await self._queue.get()) is not None:
                due, data = item
                due = max(due, self._next_free, self._stalled())
                if self._rate:  # a piece arrives once it has crossed at the rate
                    due += len(data) / self._rate
                    self._next_free = due
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._writer.write(data)
                await self._writer.drain()
            if self._writer.can_write_eof():
                self._writer.write_eof()
        except (ConnectionError, OSError):
            pass


def _status_response(status: int) -> bytes:
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}.get(status, "Error")
    body = f'{{"error": {{"code": {status}, "message": "injected by the link"}}}}'.encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n")
    if status == 429:
        head += "Retry-After: 0\r\n"
    return (head + "\r\n").encode() + body


def _drop_headers(request: bytes, names: tuple[str, ...]) -> bytes:
    head, sep, body = request.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    kept = [lines[0]] + [line for line in lines[1:]
                         if line.split(b":", 1)[0].strip().lower().decode("latin-1") not in names]
    return b"\r\n".join(kept) + sep + body


async def _read_request(reader: asyncio.StreamReader,
                        continue_: Callable[[], None]) -> bytes | None:
    """One whole HTTP/1.1 request (head and body), or None at a clean end of the stream.

    A head with ``Expect: 100-continue`` (boto3 sends it with every upload) is answered
    ``100 Continue`` by calling ``continue_``, and forwarded without it, as proxies do: the
    client would otherwise wait a second for it before it sends the body this reads."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("the client closed mid-request") from None
        return None
    except asyncio.LimitOverrunError:
        raise ConnectionError("an HTTP request head over 64 KiB") from None
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("expect", "").lower() == "100-continue":
        continue_()
        head = _drop_headers(head, ("expect",))
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts = [head]
        while True:
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    parts.append(trailer)
                parts.append(b"\r\n")
                return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    length = int(headers.get("content-length", "0") or 0)
    return head + (await reader.readexactly(length) if length else b"")


class LinkProxy:
    """A proxy in front of ``target`` (module docstring). ``http``: frame the client's bytes
    as HTTP requests (needed for ``status_every``); else bytes are passed as they come."""

    def __init__(self, target: tuple[str, int], *, rtt_s: float = 0.0,
                 rate: float | None = None, faults: Faults = Faults(), http: bool = True) -> None:
        self.target = target
        self.rtt_s = rtt_s
        self.rate = rate
        self.faults = faults
        self.http = http
        self.stats = LinkStats()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-proxy",
                                        daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._next_reset = faults.reset_every_bytes
        self._next_stall = faults.stall_every_bytes
        self._writers: set[asyncio.StreamWriter] = set()  # touched on the loop's thread only

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> LinkProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_MAX_HEAD),
            self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):  # every connection ends with the link
                writer.transport.abort()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _count(self, **increments: int) -> None:
        with self.stats._lock:
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        self._count(connections=1)
        self._writers.add(client_w)
        try:
            server_r, server_w = await asyncio.open_connection(*self.target, limit=_MAX_HEAD)
        except OSError:
            client_w.close()
            return
        except asyncio.CancelledError:
            return  # the link is closing
        self._writers.add(server_w)
        try:
            await self._relay(client_r, client_w, server_r, server_w)
        except asyncio.CancelledError:
            pass  # the link is closing: its connections were aborted
        finally:
            self._writers.discard(client_w)
            self._writers.discard(server_w)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                     server_r: asyncio.StreamReader, server_w: asyncio.StreamWriter) -> None:
        stall_until = [0.0]
        delay = self.rtt_s / 2
        to_server = _Pacer(server_w, delay=delay, rate=self.rate, stalled=lambda: stall_until[0])
        to_client = _Pacer(client_w, delay=delay, rate=self.rate, stalled=lambda: stall_until[0])
        upstream = asyncio.ensure_future(self._client_side(client_r, to_server, to_client))
        try:
            reset = await self._server_side(server_r, to_client, stall_until)
        finally:
            upstream.cancel()
            to_server.task.cancel()  # the server is done: nothing more goes to it
        if reset:
            to_client.task.cancel()
            self._reset(client_w)
            server_w.close()
            return
        to_client.close()
        await to_client.task
        for writer in (client_w, server_w):
            writer.close()

    def _reset(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        self._count(resets=1)

    async def _client_side(self, reader: asyncio.StreamReader, to_server: _Pacer,
                           to_client: _Pacer) -> None:
        every = self.faults.status_every
        try:
            while True:
                if not self.http:
                    data = await reader.read(_READ)
                    if not data:
                        break
                    self._count(to_server=len(data))
                    to_server.send(data)
                    continue
                request = await _read_request(
                    reader, lambda: to_client.send(b"HTTP/1.1 100 Continue\r\n\r\n"))
                if request is None:
                    break
                with self.stats._lock:
                    self.stats.requests += 1
                    inject = every is not None and self.stats.requests % every == 0
                if inject:
                    self._count(statuses=1)
                    to_client.send(_status_response(self.faults.status))
                    continue
                if self.faults.drop_request_headers:
                    request = _drop_headers(request, self.faults.drop_request_headers)
                self._count(to_server=len(request))
                to_server.send(request)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
            pass
        to_server.close()

    async def _server_side(self, reader: asyncio.StreamReader, to_client: _Pacer,
                           stall_until: list[float]) -> bool:
        """Relay the server's bytes; True when the connection is to be reset."""
        faults = self.faults
        try:
            while data := await reader.read(_READ):
                with self.stats._lock:
                    self.stats.to_client += len(data)
                    sent = self.stats.to_client
                    reset = self._next_reset is not None and sent >= self._next_reset
                    if reset:
                        self._next_reset = sent + (faults.reset_every_bytes or 0)
                    stall = self._next_stall is not None and sent >= self._next_stall
                    if stall:
                        self._next_stall = sent + (faults.stall_every_bytes or 0)
                        self.stats.stalls += 1
                if stall:
                    stall_until[0] = time.monotonic() + faults.stall_s
                if reset:
                    to_client.send(data[:len(data) // 2])  # mid-response
                    await asyncio.sleep(self.rtt_s / 2 + 0.01)
                    return True
                to_client.send(data)
        except (ConnectionError, OSError):
            pass
        return False
