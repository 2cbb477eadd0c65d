"""GCS-only behaviour of :class:`cairn.store.gcs.GCSBackend`, against a real fake-gcs-server.

The shared contracts are in ``test_backend_conformance.py``; these pin what only GCS has:
the missing-bucket message, single-request create-only uploads above the client's multipart
threshold, transfer checksums, and retries that must not turn our own write into a conflict.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from cairn.exceptions import AlreadyExists, ConfigError, NotFound, StoreError

pytestmark = pytest.mark.gcs

storage = pytest.importorskip("google.cloud.storage")

from google.auth.credentials import AnonymousCredentials  # noqa: E402

from cairn.store.gcs import GCSBackend  # noqa: E402

Request = Callable[..., object]


@pytest.fixture()
def client(gcs_server: str) -> Iterator[storage.Client]:
    c = storage.Client(project="cairn-test", credentials=AnonymousCredentials())
    yield c
    c.close()


def intercept(monkeypatch: pytest.MonkeyPatch, client: storage.Client,
              hook: Callable[[Request, str, str, dict], object]) -> None:
    """Route every HTTP request of ``client`` through ``hook(send, method, url, kwargs)``."""
    session = client._http
    send = session.request

    def request(method: str, url: str, **kwargs: object) -> object:
        return hook(send, method, url, kwargs)

    monkeypatch.setattr(session, "request", request)


def test_missing_bucket_is_a_config_error_naming_the_fix(gcs_server: str) -> None:
    from cairn.store.url import open_backend

    with pytest.raises(ConfigError, match=r"gcloud storage buckets create gs://cairn-no-such-bkt"):
        GCSBackend("cairn-no-such-bkt", "p")
    with pytest.raises(ConfigError, match="cairn-no-such-bkt"):
        open_backend("gs://cairn-no-such-bkt/some/prefix")


def test_missing_bucket_found_lazily_without_the_check(gcs_server: str) -> None:
    backend = GCSBackend("cairn-no-such-bkt", "p", check_bucket=False)
    try:
        with pytest.raises(ConfigError, match="gcloud storage buckets create"):
            backend.create("a", b"x")
        with pytest.raises(ConfigError, match="gcloud storage buckets create"):
            list(backend.list(""))
    finally:
        backend.close()


@pytest.mark.parametrize("prefix, stored", [("", "a/b"), ("/p/q/", "p/q/a/b")])
def test_object_names_under_the_prefix(
    gcs_bucket: str, client: storage.Client, prefix: str, stored: str
) -> None:
    backend = GCSBackend(gcs_bucket, prefix, client=client)
    backend.create("a/b", b"x")
    assert [b.name for b in client.list_blobs(gcs_bucket)] == [stored]
    assert [i.name for i in backend.list("")] == ["a/b"]
    assert backend.url == (f"gs://{gcs_bucket}/p/q" if prefix.strip("/") else f"gs://{gcs_bucket}")


@pytest.mark.parametrize("size", [3 << 20, 20 << 20], ids=["3MiB", "20MiB"])
def test_large_streaming_write_is_one_create_only_request(
    gcs_bucket: str, client: storage.Client, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    uploads: list[str] = []

    def record(send: Request, method: str, url: str, kwargs: dict) -> object:
        if "/upload/" in url:
            uploads.append(url)
        return send(method, url, **kwargs)

    intercept(monkeypatch, client, record)
    backend = GCSBackend(gcs_bucket, "big", client=client)
    first = os.urandom(size)
    with backend.open_writer("packs/p") as writer:
        for i in range(0, size, 1 << 20):
            writer.write(memoryview(first)[i : i + (1 << 20)])
        writer.commit()
    with backend.open_writer("packs/p") as writer:
        writer.write(b"second")
        with pytest.raises(AlreadyExists):
            writer.commit()

    # One request per commit, both multipart with the create-only precondition; a resumable
    # upload (the client's choice above 8 MiB) would be several, and the emulator ignores
    # the precondition on it.
    assert len(uploads) == 2
    assert all("uploadType=multipart" in u and "ifGenerationMatch=0" in u for u in uploads)
    assert backend.stat("packs/p").size == size
    assert backend.read("packs/p") == first
    assert backend.read_range("packs/p", size - 7, 100) == first[-7:]
    assert backend.read_range("packs/p", size, 10) == b""


def test_upload_sends_crc32c_and_corruption_in_transit_is_rejected(
    gcs_bucket: str, client: storage.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64

    import google_crc32c

    payload = b"\x00\x01payload" * 1000
    bodies: list[bytes] = []

    def corrupt(send: Request, method: str, url: str, kwargs: dict) -> object:
        if "uploadType=multipart" in url:
            bodies.append(kwargs["data"])
            kwargs["data"] = kwargs["data"].replace(b"\x00\x01payload", b"\x00\x02payload", 1)
        return send(method, url, **kwargs)

    intercept(monkeypatch, client, corrupt)
    backend = GCSBackend(gcs_bucket, "crc", client=client)
    with pytest.raises(StoreError, match="corrupted in transit"):
        backend.create("obj", payload)

    crc = base64.b64encode(google_crc32c.value(payload).to_bytes(4, "big")).decode()
    assert f'"crc32c": "{crc}"'.encode() in bodies[0]
    # Nothing corrupt is left behind under the name.
    with pytest.raises(NotFound):
        backend.stat("obj")


def test_full_read_verifies_crc32c(
    gcs_bucket: str, client: storage.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = GCSBackend(gcs_bucket, "crc", client=client)
    backend.create("obj", b"some bytes")

    def wrong_hash(send: Request, method: str, url: str, kwargs: dict) -> object:
        response = send(method, url, **kwargs)
        if "alt=media" in url:
            response.headers["X-Goog-Hash"] = "crc32c=AAAAAA=="  # what a corrupted body looks like
        return response

    intercept(monkeypatch, client, wrong_hash)
    with pytest.raises(StoreError, match="corrupted in transit"):
        backend.read("obj")
    assert backend.read_range("obj", 0, 4) == b"some"  # ranges cannot be checked: not an error


def test_create_retried_after_a_lost_response_is_not_a_conflict(
    gcs_bucket: str, client: storage.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import requests

    sent: list[str] = []

    def lose_first_response(send: Request, method: str, url: str, kwargs: dict) -> object:
        response = send(method, url, **kwargs)
        if "uploadType=multipart" in url:
            sent.append(url)
            if len(sent) == 1:
                raise requests.ConnectionError("connection reset after the request was sent")
        return response

    intercept(monkeypatch, client, lose_first_response)
    backend = GCSBackend(gcs_bucket, "retry", client=client)
    backend.create("log/1", b"mine")  # the retry gets 412 from our own first attempt
    assert len(sent) == 2
    assert backend.read("log/1") == b"mine"
    with pytest.raises(AlreadyExists):  # a real conflict is still one
        backend.create("log/1", b"mine")


def test_version_and_conditional_delete(gcs_bucket: str, client: storage.Client) -> None:
    backend = GCSBackend(gcs_bucket, "v", client=client)
    backend.create("o", b"x")
    info = backend.stat("o")
    blob = client.bucket(gcs_bucket).get_blob("v/o")
    assert info.version == f"{blob.generation}.{blob.metageneration}"
    assert info.updated == blob.updated.timestamp()
    with pytest.raises(ConfigError):
        backend.delete("o", if_version="not-a-version")
    backend.delete("o", if_version=info.version)
    with pytest.raises(NotFound):
        backend.delete("o", if_version=info.version)


def test_close_leaves_a_passed_client_open(gcs_bucket: str, client: storage.Client) -> None:
    GCSBackend(gcs_bucket, "c", client=client).close()
    assert client.bucket(gcs_bucket).blob("nope").exists() is False  # still usable


def test_importing_the_url_module_does_not_need_the_gcs_client() -> None:
    code = "import sys, cairn.store.url; assert 'google.cloud.storage' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
