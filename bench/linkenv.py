"""What the benches through a slow link share: the link proxy in a child process, the sink
servers of the proxy-alone ceiling, CPU and RSS of a process, ``measure``, raw HTTP, boto3.

Used by ``s3_client_bench.py`` and ``store_link_bench.py`` (and ``link_peers.py``), which
import it as ``linkenv`` (``bench/`` is on ``sys.path`` when a script in it runs; the script
puts the repository root there too, for ``tests.support``). The proxy is the tests'
``LinkProxy`` (``tests/support/link.py``), run in a spawned child process so that its event
loop does not share the bench's GIL.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import multiprocessing
import os
import resource
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.link import LinkProxy
from tests.support.s3_server import FAKE_CREDENTIALS as CREDS

MiB = 1 << 20
# write(), read() (timed), got() the bytes read (pieces, in order), close()
SideParts = tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any], Callable[[], Any]]


# -- the link proxy in a child process ------------------------------------------------------------

class _CountingLink(LinkProxy):
    """LinkProxy that also counts the connections open at once (the most since a reset)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_now = 0
        self.peak = 0

    async def _serve(self, client_r: Any, client_w: Any) -> None:
        self.open_now += 1
        self.peak = max(self.peak, self.open_now)
        try:
            await super()._serve(client_r, client_w)
        finally:
            self.open_now -= 1


def _proxy_child(conn: Any, target: tuple[str, int], rtt_s: float, rate: float,
                 count_open: bool) -> None:
    with (_CountingLink if count_open else LinkProxy)(target, rtt_s=rtt_s, rate=rate) as link:
        conn.send(link.port)
        while (command := conn.recv()) != "stop":
            if not count_open:
                conn.send(link.stats.snapshot())
                continue
            if command == "reset_peak":
                link.peak = link.open_now
            conn.send({**link.stats.snapshot(), "peak": link.peak})


class ProxyProcess:
    """A link proxy in a spawned child process; ``stats()``: its LinkStats snapshot, and with
    ``count_open`` (a LinkProxy subclass that counts open connections) also ``peak``, the most
    connections open at once since the last ``stats(reset_peak=True)``."""

    def __init__(self, target: tuple[str, int], rtt_s: float, rate: float, *,
                 count_open: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_proxy_child, daemon=True,
                                   args=(child, target, rtt_s, rate, count_open))
        self.process.start()
        self.port = self._conn.recv()
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self, *, reset_peak: bool = False) -> dict[str, int]:
        self._conn.send("reset_peak" if reset_peak else "stats")
        return self._conn.recv()

    def stop(self) -> None:
        self._conn.send("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()


# -- sinks: the far end of the proxy-alone ceiling ---------------------------------------------

class SinkHandler(BaseHTTPRequestHandler):
    """A sink in the bench's process: PUT bodies are dropped; GET /start-end gets those bytes
    of ``payload``."""
    protocol_version = "HTTP/1.1"
    payload = memoryview(b"")

    def log_message(self, *args: Any) -> None:
        pass

    def do_PUT(self) -> None:
        left = int(self.headers["Content-Length"])
        while left > 0 and (chunk := self.rfile.read(min(left, MiB))):
            left -= len(chunk)
        self._reply(b"")

    def do_GET(self) -> None:
        start, end = map(int, self.path.strip("/").split("-"))
        self._reply(self.payload[start:end])

    def _reply(self, body: Any) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class SinkServer(ThreadingHTTPServer):
    request_queue_size = 128
    daemon_threads = True


async def _sink_serve(payload: memoryview, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
    """One connection of the sink: a PUT's body is dropped, GET /N answers N bytes."""
    try:
        while head := await reader.readuntil(b"\r\n\r\n"):
            method, path = head.split(b" ", 2)[:2]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            while length > 0:
                length -= len(await reader.read(min(length, MiB)))
            body = payload[:int(path.strip(b"/"))] if method == b"GET" else b""
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


def _sink_child(conn: Any, piece: int) -> None:
    """A sink HTTP server on an asyncio loop (a threaded http.server took the proxy's
    ceiling for reads down to 160-260 MB/s where fake-gcs-server's Go server got 480)."""
    payload = memoryview(os.urandom(piece))
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(
        lambda r, w: _sink_serve(payload, r, w), "127.0.0.1", 0, backlog=256))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    conn.send(server.sockets[0].getsockname()[1])
    conn.recv()


class SinkProcess:
    """The asyncio sink in a spawned child process, answering GETs from ``piece`` bytes."""

    def __init__(self, piece: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_sink_child, daemon=True, args=(child, piece))
        self.process.start()
        self.port = self._conn.recv()

    def stop(self) -> None:
        self._conn.send("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()


# -- measuring ------------------------------------------------------------------------------------

def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` (None: this process)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int | None) -> float:
    """Peak RSS (VmHWM) of ``pid`` (None: this process) in MiB; OSError or StopIteration
    when it cannot be read."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def measure(fn: Callable[[], Any], size: int, proxy: ProxyProcess | None,
            pids: dict[str, int | None], *,
            counters: tuple[str, ...] = ("connections", "requests"),
            peak: bool = False) -> dict[str, Any]:
    """Time ``fn()``: seconds, MB/s of ``size`` bytes, the growth of the proxy's ``counters``
    (None without a proxy), with ``peak`` its most connections open at once, and the CPU of
    each of ``pids`` in % of one core."""
    stats0 = proxy.stats(reset_peak=peak) if proxy else {}
    cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    cpu1 = {n: cpu_seconds(p) for n, p in pids.items()}
    stats1 = proxy.stats() if proxy else {}
    out: dict[str, Any] = {"seconds": round(seconds, 3), "mbps": round(size / seconds / 1e6, 1)}
    for name in counters:
        out[name] = stats1[name] - stats0[name] if proxy else None
    if peak:
        out["peak_connections"] = stats1["peak"] if proxy else None
    out["cpu_pct"] = {n: round((cpu1[n] - cpu0[n]) / seconds * 100) for n in pids}
    return out


def spans(total: int, piece: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut in ``piece``-sized (start, end) spans, the last one shorter."""
    return [(start, min(start + piece, total)) for start in range(0, total, piece)]


def in_threads(fn: Callable[[int], Any], n: int, k: int) -> None:
    """``fn(0)`` .. ``fn(n - 1)`` on a pool of k threads; the first error is raised."""
    with ThreadPoolExecutor(k) as pool:
        list(pool.map(fn, range(n)))


# -- raw HTTP (the ceilings) ----------------------------------------------------------------------

def raw_http(host: str, port: int, data: memoryview, parts: list[tuple[int, int]], k: int,
             request: Callable[[str, int], tuple[str, str, dict[str, str]]], *,
             got: list[Any] | None = None, ok: tuple[int, ...] = (200, 201)
             ) -> tuple[Callable[[], None], Callable[[], None]]:
    """Write then read ``parts`` of ``data`` with k threads, one connection each;
    ``request(direction, i)`` gives the method, path and headers of part i. A status not in
    ``ok`` is an error. With ``got``, each GET's body is kept in ``got[i]``; without, only its
    length is checked."""
    local = threading.local()

    def call(direction: str, i: int) -> None:
        if getattr(local, "conn", None) is None:
            local.conn = http.client.HTTPConnection(host, port, timeout=300)
        method, path, headers = request(direction, i)
        body = data[slice(*parts[i])] if direction == "write" else None
        local.conn.request(method, path, body=body, headers=headers)
        response = local.conn.getresponse()
        content = response.read()
        if response.status not in ok:
            raise RuntimeError(f"{method} part {i}: HTTP {response.status} {content[:200]!r}")
        if direction == "read":
            if got is not None:
                got[i] = content
            elif len(content) != parts[i][1] - parts[i][0]:
                raise RuntimeError(f"GET part {i}: {len(content)} bytes")
    return (lambda: in_threads(lambda i: call("write", i), len(parts), k),
            lambda: in_threads(lambda i: call("read", i), len(parts), k))


# -- S3 with boto3 --------------------------------------------------------------------------------

def boto_client(endpoint: str, pool: int, create_only_mpu: bool = False) -> Any:
    """A boto3 S3 client of ``endpoint`` (path addressing, the fake credentials), its HTTP pool
    ``pool`` connections; ``create_only_mpu``: a hook adds ``IfNoneMatch="*"`` to
    CompleteMultipartUpload (s3transfer's ExtraArgs does not take it)."""
    import boto3
    from botocore.config import Config
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=CREDS["AWS_DEFAULT_REGION"],
        aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=pool))
    if create_only_mpu:
        client.meta.events.register("before-parameter-build.s3.CompleteMultipartUpload",
                                    lambda params, **_: params.setdefault("IfNoneMatch", "*"))
    return client


def boto3_transfer(endpoint: str, bucket: str, data: Any, part: int, k: int) -> SideParts:
    """``upload_fileobj`` / ``download_fileobj`` of one object, parts of ``part`` bytes, k in
    flight (``max_concurrency``, ``max_in_memory_upload_chunks``, ``max_pool_connections``)."""
    from boto3.s3.transfer import TransferConfig
    client = boto_client(endpoint, k, create_only_mpu=True)
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=k)
    # s3transfer reads at most 10 parts of a stream ahead (max_in_memory_upload_chunks, not a
    # boto3 TransferConfig argument): without this, upload_fileobj has <= 10 parts in flight
    config.max_in_memory_upload_chunks = max(10, k)
    sink = io.BytesIO()
    sink.write(bytes(len(data)))  # preallocated: download_fileobj seeks and writes each part
    return (lambda: client.upload_fileobj(io.BytesIO(data), bucket, "blob", Config=config),
            lambda: client.download_fileobj(bucket, "blob", sink, Config=config),
            lambda: [sink.getbuffer()], client.close)


def boto3_objects(endpoint: str, bucket: str, data: Any, piece: int, k: int) -> SideParts:
    """``piece``-sized objects, ``put_object(IfNoneMatch="*")`` / ``get_object().read()`` from
    a ThreadPoolExecutor of k, ``max_pool_connections=k``."""
    client, parts, view = boto_client(endpoint, k), spans(len(data), piece), memoryview(data)
    got: list[bytes] = [b""] * len(parts)

    def put(i: int) -> None:
        client.put_object(Bucket=bucket, Key=f"obj-{i:05d}", IfNoneMatch="*",
                          Body=bytes(view[slice(*parts[i])]))

    def get(i: int) -> None:
        got[i] = client.get_object(Bucket=bucket, Key=f"obj-{i:05d}")["Body"].read()
    return (lambda: in_threads(put, len(parts), k), lambda: in_threads(get, len(parts), k),
            lambda: got, client.close)


def presigned(admin: Any, bucket: str, n: int) -> Callable[[str, int], str]:
    """``paths(method, i)``: the path and query of a presigned PUT or GET of ``raw-{i}``."""
    urls = {(method, i): urllib.parse.urlsplit(admin.generate_presigned_url(
        op, Params={"Bucket": bucket, "Key": f"raw-{i:05d}"}, ExpiresIn=3600))
        for method, op in (("PUT", "put_object"), ("GET", "get_object")) for i in range(n)}
    return lambda method, i: f"{urls[method, i].path}?{urls[method, i].query}"


def empty_bucket(admin: Any, bucket: str) -> None:
    """Delete every object and multipart upload of an S3 bucket, then the bucket."""
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        if keys := [{"Key": o["Key"]} for o in page.get("Contents", [])]:
            admin.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    for upload in admin.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        admin.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    admin.delete_bucket(Bucket=bucket)
