"""The link harness (``tests/support/link.py``) does what it says, against real servers: a
TCP sink and the fake-gcs-server process, reached through the proxy by cairn's own GCS
backend. Only lower bounds of time are asserted (a loaded machine is slower, never faster):
the delay and the cap are the link's, not the test's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest

from cairn.store.backend import Backend
from tests.support.link import Faults, LinkProxy


def _sink_server() -> tuple[socket.socket, threading.Thread]:
    """A TCP server that answers each message with its length (8 bytes) once it has read it
    (the client sends the length first)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer(conn: socket.socket) -> None:
        with conn:
            while header := conn.recv(8, socket.MSG_WAITALL):
                want, got = int.from_bytes(header, "big"), 0
                while got < want:
                    got += len(conn.recv(min(1 << 20, want - got)))
                conn.sendall(got.to_bytes(8, "big"))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _send(port: int, size: int) -> float:
    """Seconds from sending ``size`` bytes through ``port`` to the server's answer."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        start = time.monotonic()
        conn.sendall(size.to_bytes(8, "big") + bytes(size))
        assert int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big") == size
        return time.monotonic() - start


def test_a_round_trip_takes_the_links_delay_and_a_transfer_its_cap() -> None:
    listener, _ = _sink_server()
    try:
        target = listener.getsockname()
        with LinkProxy(target, rtt_s=0.1, http=False) as link:
            assert _send(link.port, 10) >= 0.1  # there and back
        with LinkProxy(target, rate=4 << 20, http=False) as link:
            assert _send(link.port, 2 << 20) >= 0.45  # 2 MiB at 4 MiB/s
            assert link.stats.snapshot()["to_server"] == (2 << 20) + 8
    finally:
        listener.close()


@pytest.fixture()
def gcs_through(gcs_server: str, gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
                ) -> Iterator[tuple[str, Callable[..., LinkProxy]]]:
    """``(bucket, link)``: ``link(**options)`` puts a LinkProxy before the fake-gcs-server
    and points google-cloud-storage at it."""
    server = urlsplit(gcs_server)

    def link(**options: object) -> LinkProxy:
        proxy = LinkProxy((server.hostname, server.port), **options)
        proxy.__enter__()
        opened.append(proxy)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://{proxy.address}")
        return proxy

    opened: list[LinkProxy] = []
    try:
        yield gcs_bucket, link
    finally:
        for proxy in opened:
            proxy.__exit__(None, None, None)


def _backend(url: str) -> Backend:
    from cairn.store.url import open_backend

    return open_backend(url)


def _url(bucket: str) -> str:
    return f"gs://{bucket}/link-{os.urandom(3).hex()}"


def _big_object(bucket: str) -> tuple[bytes, str]:
    """3 MiB of random bytes written as ``big`` in a fresh store prefix (straight to the
    server); the bytes and the prefix's URL."""
    data, url = os.urandom(3 << 20), _url(bucket)
    backend = _backend(url)
    try:
        backend.create("big", data)
    finally:
        backend.close()
    return data, url


@pytest.mark.gcs
def test_cairn_s_gcs_backend_retries_injected_503s_and_429s(gcs_through) -> None:
    bucket, link = gcs_through
    for status in (503, 429):
        proxy = link(faults=Faults(status_every=3, status=status))
        backend = _backend(_url(bucket))
        try:
            for i in range(6):
                backend.create(f"objects/{i}", bytes([i]) * 1000)
            assert [backend.read(f"objects/{i}") for i in range(6)] == \
                [bytes([i]) * 1000 for i in range(6)]
        finally:
            backend.close()
        stats = proxy.stats.snapshot()
        assert stats["statuses"] >= 4, stats  # a third of at least 12 requests


@pytest.mark.gcs
def test_a_reset_mid_download_is_resumed_and_the_object_read_whole(gcs_through) -> None:
    """The proxy resets the connection each time another MiB went to the client: cairn's GCS
    backend reads the 3 MiB object whole, resuming where each reset cut it (fewer bytes
    crossed the link than two whole downloads), never returning the cut response."""
    bucket, link = gcs_through
    data, url = _big_object(bucket)
    proxy = link(faults=Faults(reset_every_bytes=1 << 20))
    backend = _backend(url)
    try:
        got = backend.read("big")
    finally:
        backend.close()
    stats = proxy.stats.snapshot()
    assert got == data
    assert stats["resets"] >= 1 and stats["to_client"] < 2 * len(data), stats


@pytest.mark.gcs
def test_a_stalled_link_delays_the_read_and_the_object_comes_back_whole(gcs_through) -> None:
    bucket, link = gcs_through
    data, url = _big_object(bucket)
    proxy = link(faults=Faults(stall_every_bytes=1 << 20, stall_s=0.5))
    backend = _backend(url)
    try:
        start = time.monotonic()
        got = backend.read("big")
        took = time.monotonic() - start
    finally:
        backend.close()
    stats = proxy.stats.snapshot()
    assert got == data and stats["stalls"] >= 2, stats
    assert took >= 0.5 * stats["stalls"] - 0.5  # the stalls were served (the last may trail)
