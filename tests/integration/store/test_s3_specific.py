"""What the S3 backend does beyond the conformance suite, against moto's S3 server process
(a fake of Amazon S3: tests/support/s3_server.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from pathlib import Path

import botocore.exceptions as bexc
import pytest

from cairn import open_store
from cairn.exceptions import AlreadyExists, ConfigError, StoreUnreachable
from cairn.store import Key, StoreSettings
from cairn.store import s3 as s3_module
from cairn.store.kinds import store_kind
from cairn.store.s3 import S3Backend
from cairn.store.url import open_backend
from tests.support.link import Faults, LinkProxy
from tests.support.s3_server import S3Server


def _status(e: bexc.ClientError) -> int:
    return e.response["ResponseMetadata"]["HTTPStatusCode"]


def test_the_server_enforces_the_conditions_cairn_relies_on(s3_server: S3Server,
                                                           s3_bucket: str) -> None:
    """The fake must be faithful where it matters: a create-only put, a create-only multipart
    completion and a conditional delete each answer 412 when their condition fails."""
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(bexc.ClientError) as put:
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"2", IfNoneMatch="*")
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key="k")["UploadId"]
    part = client.upload_part(Bucket=s3_bucket, Key="k", UploadId=upload, PartNumber=1, Body=b"3")
    with pytest.raises(bexc.ClientError) as complete:
        client.complete_multipart_upload(
            Bucket=s3_bucket, Key="k", UploadId=upload, IfNoneMatch="*",
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    with pytest.raises(bexc.ClientError) as delete:
        client.delete_object(Bucket=s3_bucket, Key="k", IfMatch='"not-its-etag"')
    assert [_status(e.value) for e in (put, complete, delete)] == [412, 412, 412]
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"1"


def test_an_endpoint_that_ignores_if_none_match_is_refused(
        s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a link that drops ``If-None-Match`` (as an endpoint without conditional writes
    ignores it), opening the store is refused, naming the problem; nothing is left behind."""
    with LinkProxy(("127.0.0.1", s3_server.port),
                   faults=Faults(drop_request_headers=("if-none-match",))) as link:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{link.port}")
        with pytest.raises(ConfigError, match="ignores If-None-Match.*conditional writes"):
            open_backend(f"s3://{s3_bucket}/p")
    assert s3_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0


def test_a_large_streaming_write_is_a_create_only_multipart_upload(
        s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_module, "MULTIPART_THRESHOLD", 1 << 20)
    monkeypatch.setattr(s3_module, "PART_BYTES", 5 << 20)  # S3's smallest part but the last
    data = bytes(range(256)) * (47 << 10)  # 11.75 MiB: three parts
    backend = S3Backend(s3_bucket, "p")
    with backend.open_writer("packs/big") as writer:
        for start in range(0, len(data), 3 << 20):
            writer.write(data[start:start + (3 << 20)])
        writer.commit()
    assert backend.read("packs/big") == data
    with backend.open_writer("packs/big") as writer:
        writer.write(data)
        with pytest.raises(AlreadyExists):
            writer.commit()
    assert backend.read_range("packs/big", 5 << 20, 10) == data[5 << 20:(5 << 20) + 10]


def test_a_create_retried_after_a_lost_response_is_not_a_conflict(s3_bucket: str) -> None:
    """The retry of a create whose first answer was lost gets a 412 from its own object: the
    upload token tells it apart from another writer's."""
    backend = S3Backend(s3_bucket, "p")
    token = uuid.uuid4().hex
    backend._put("keys/a/0000000001.snap", b"record", token=token)
    backend._put("keys/a/0000000001.snap", b"record", token=token)  # the retry: success
    with pytest.raises(AlreadyExists):
        backend._put("keys/a/0000000001.snap", b"record", token=uuid.uuid4().hex)


def test_a_missing_bucket_is_a_config_error_naming_the_fix(s3_server: S3Server) -> None:
    with pytest.raises(ConfigError, match="does not exist.*aws s3 mb s3://cairn-missing"):
        open_backend("s3://cairn-missing/p")


def test_a_closed_endpoint_is_unreachable_within_the_bound(
        s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(StoreUnreachable, match="cannot reach the store s3://b-x/p"):
        S3Backend("b-x", "p", connect_timeout=1.0)


@pytest.mark.parametrize("url, problem", [
    ("s3://", "has no bucket"),
    ("s3://Bad_Bucket/p", "is not a bucket name"),
    ("s3://bucket/p?versionId=1", "query or fragment"),
])
def test_malformed_urls_name_the_form(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem + ".*s3://BUCKET/PREFIX"):
        store_kind(url)


def test_an_s3_store_is_remote() -> None:
    """A remote store: reached the same from every node, written by whoever holds its
    credentials, so `cairn run` as root refuses to restore from it unencrypted (ADR 0025)."""
    assert store_kind("s3://bucket/p").remote


def test_a_versioned_bucket_keeps_snapshots_and_frees_them_in_two_passes(
        s3_server: S3Server) -> None:
    """On a versioned bucket a touch and a delete leave noncurrent versions, which only the
    documented lifecycle rule frees; cairn's own view is the same as on any bucket."""
    bucket = s3_server.make_bucket(f"cairn-{uuid.uuid4().hex[:12]}", versioned=True)
    key = Key.parse("dag/versioned/run/0")
    with open_store(f"s3://{bucket}/v", settings=StoreSettings(keep_last=1)) as store:
        attempt = store.open_attempt(key)
        for content in (b"a" * 200_000, b"b" * 200_000):
            with attempt.snapshot() as snap:
                snap.add_bytes("state.bin", content)
                last = snap.commit()
        assert [info.seq for info in store.snapshots(key)] == [last.seq]
        time.sleep(1.2)  # GC counts ages from the end of LastModified's second
        assert store.gc(grace_seconds=0).condemned
        time.sleep(1.2)
        assert store.gc(grace_seconds=0).deleted
        assert store.reader(last).read_file("state.bin") == b"b" * 200_000
        assert store.verify(key).ok
    versions = s3_server.client().list_object_versions(Bucket=bucket, Prefix="v/packs/")
    assert versions.get("DeleteMarkers"), "deleted packs stay as noncurrent versions"


def test_the_documented_lifecycle_rule_is_accepted(s3_server: S3Server, s3_bucket: str) -> None:
    text = (Path(__file__).parents[3] / "docs" / "store-backends.md").read_text()
    rule = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    client = s3_server.client()
    client.put_bucket_lifecycle_configuration(Bucket=s3_bucket, LifecycleConfiguration=rule)
    stored = client.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"][0]
    assert stored["NoncurrentVersionExpiration"]["NoncurrentDays"] == 1
    assert stored["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 1


@pytest.mark.parametrize("how", ["whole", "range"])
def test_a_reset_mid_download_is_resumed_and_the_object_read_whole(
        s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The link resets the connection each time another MiB went to the client: the backend
    reads the 3 MiB object whole, asking again from where each reset cut it (fewer bytes
    crossed the link than two whole downloads), never returning the cut response."""
    data = os.urandom(3 << 20)
    S3Backend(s3_bucket, "p").create("packs/big", data)
    with LinkProxy(("127.0.0.1", s3_server.port),
                   faults=Faults(reset_every_bytes=1 << 20)) as link:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{link.address}")
        backend = S3Backend(s3_bucket, "p")
        if how == "whole":
            got = backend.read("packs/big")
        else:
            buffer = bytearray(len(data) - 5)
            assert backend.read_range_into("packs/big", 5, memoryview(buffer)) == len(buffer)
            got = data[:5] + bytes(buffer)
        stats = link.stats.snapshot()
    assert got == data
    assert stats["resets"] >= 2 and stats["to_client"] < 2 * len(data), stats


def test_injected_503s_are_retried(s3_server: S3Server, s3_bucket: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 throttles with 503 SlowDown (and fails with 500s): botocore's standard retries take
    both. A bare 429 (S3-compatible servers and proxies send it; S3 does not) is retried by
    cairn's own handler: botocore 1.35.99, the range's low end, did not retry it."""
    for status in (503, 500, 429):
        with LinkProxy(("127.0.0.1", s3_server.port),
                       faults=Faults(status_every=3, status=status)) as link:
            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{link.address}")
            backend = S3Backend(s3_bucket, f"retried-{status}")
            for i in range(3):
                backend.create(f"objects/{i}", bytes([i]) * 1000)
            assert [backend.read(f"objects/{i}") for i in range(3)] == \
                [bytes([i]) * 1000 for i in range(3)]
            stats = link.stats.snapshot()
        assert stats["statuses"] >= 3, stats  # a third of at least 10 requests (the open's too)


class _Answer:
    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status_code, self.headers = status, headers


def test_a_429_is_retried_within_the_attempts_after_its_retry_after() -> None:
    from cairn.store.s3 import retry_too_many_requests

    needs_retry = retry_too_many_requests(max_attempts=3)
    delay = needs_retry(1, response=(_Answer(429, {"Retry-After": "2"}), {}))
    assert delay is not None and 2.0 <= delay <= 20.0
    assert needs_retry(1, response=(_Answer(429, {"Retry-After": "3600"}), {})) <= 20.0
    assert 0.0 <= needs_retry(2, response=(_Answer(429, {}), {})) <= 2.0  # no header: backoff
    assert needs_retry(3, response=(_Answer(429, {}), {})) is None  # the attempts are spent
    for other in (503, 200, 404):  # botocore's own handler decides
        assert needs_retry(1, response=(_Answer(other, {}), {})) is None
    assert needs_retry(1, response=None, caught_exception=ConnectionError()) is None
