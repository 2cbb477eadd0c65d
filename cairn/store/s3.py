"""S3Backend: objects in an S3 bucket (Amazon S3 or an S3-compatible endpoint), below an
optional prefix. Object ``name`` is stored as ``PREFIX/name``.

* **Create-only.** Every create is a PutObject (a multipart upload above
  :data:`MULTIPART_THRESHOLD`) with ``If-None-Match: *``; S3 answers 412 when the name is
  taken, which becomes :class:`AlreadyExists`. A 409 (a conditional write racing another) is
  retried until one answer decides. An endpoint that ignores the condition would let two
  attempts both "win" a slot-log seq, so opening a store probes it once per process and
  refuses an endpoint that accepts a second create (as NFS is refused for local stores).
* **Integrity.** Uploads carry a CRC32 checksum that S3 checks; readers verify chunk digests.
* **Versions.** ``ObjectInfo.version`` is ``"ETAG.SECONDS"`` (the ETag and ``LastModified``),
  which a touch (a copy of the object onto itself) or a re-create changes once
  ``LastModified`` moves: S3 keeps it to the second (:attr:`version_resolution_seconds`).
  ``delete(if_version=)`` compares the version, then deletes with ``If-Match: ETAG``; a touch
  keeps the ETag, so a touch racing that delete is not caught
  (:attr:`guarded_deletes` is False): garbage collection condemns before it deletes
  (:mod:`cairn.store.gc`, ADR 0048).

Credentials and endpoint: boto3's default chain (environment, ``AWS_PROFILE``, IRSA web
identity, EKS Pod Identity, the instance role) and ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3``; with a custom endpoint, path-style addressing (MinIO and most
S3-compatible servers need it). SSE-KMS is the bucket's default encryption, which S3 applies
to every object cairn writes or touches (it names none). Needs ``s3:GetObject``, ``s3:PutObject``, ``s3:DeleteObject`` and
``s3:ListBucket``. Requires boto3 >= 1.35.67 (DeleteObject's ``If-Match``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from cairn.exceptions import (
    AlreadyExists,
    CairnError,
    ConfigError,
    NotFound,
    PreconditionFailed,
    StoreError,
    StoreUnreachable,
)
from cairn.store.backend import (
    SCRATCH_PREFIX,
    Backend,
    BlobWriter,
    BufferedWriter,
    ObjectInfo,
    check_object_name,
    prefixed,
)
from cairn.store.kind_s3 import bucket_and_prefix

log = logging.getLogger(__name__)

#: Objects larger than this are uploaded in parts (packs are 32 MiB by default: one request).
MULTIPART_THRESHOLD = 64 << 20
PART_BYTES = 16 << 20
#: How long the first contact (opening the backend) may take in all, retries included,
#: before the store counts as unreachable (ADR 0032).
DEFAULT_CONNECT_TIMEOUT = 30.0
_CONTACT_REQUEST_TIMEOUT = 10.0
_CONTACT_FIRST_DELAY, _CONTACT_MAX_DELAY = 0.25, 4.0
_UPLOAD_TOKEN_KEY = "cairn-upload"
_TOUCH_KEY = "cairn-touched"
_CONFLICT_RETRIES = 8
_BODY_RETRIES = 5
_READ_PIECE = 256 << 10
_NETWORK = (bexc.EndpointConnectionError, bexc.ConnectionClosedError, bexc.ConnectTimeoutError,
            bexc.ReadTimeoutError, bexc.ResponseStreamingError, bexc.IncompleteReadError,
            ConnectionError, TimeoutError)
_TRANSIENT_CODES = {"500", "502", "503", "504", "SlowDown", "InternalError", "ServiceUnavailable",
                    "RequestTimeout", "Throttling", "ThrottlingException", "TooManyRequests",
                    "429"}
#: Backoff of a retried 429 (botocore's standard mode's own: full jitter, 20 s at most).
_THROTTLED_BASE_S, _THROTTLED_MAX_S = 0.5, 20.0
_probed: dict[tuple[str, str], str | None] = {}
_probe_lock = threading.Lock()


def open_url(url: str, *, create: bool = True,
             connect_timeout: float | None = None) -> S3Backend:
    """The ``s3`` kind's opener (:mod:`cairn.store.kind_s3`). A bucket is never created."""
    del create
    bucket, prefix = bucket_and_prefix(url)
    if connect_timeout is None:
        return S3Backend(bucket, prefix)
    return S3Backend(bucket, prefix, connect_timeout=connect_timeout)


def _code(e: bexc.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: bexc.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _precondition_failed(e: bexc.ClientError) -> bool:
    """The request's condition (If-None-Match, If-Match) did not hold."""
    return _status(e) == 412 or _code(e) == "PreconditionFailed"


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Backend(Backend):
    """Objects in ``s3://bucket/prefix``. See the module docstring for the guarantees.

    ``client``: a ready boto3 S3 client (the caller keeps ownership). ``max_workers``: how many
    threads may call at once; it sizes the connection pool. ``check_bucket``: list the bucket
    now (a missing bucket: :class:`ConfigError`; refused: :class:`StoreError`; not reached
    within ``connect_timeout`` seconds, retries included: :class:`StoreUnreachable`) and probe
    that the endpoint enforces ``If-None-Match``.
    """

    guarded_deletes = False
    version_resolution_seconds = 1.0

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None,
                 max_workers: int = 32, timeout: float = 60.0, check_bucket: bool = True,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        bucket_and_prefix(f"s3://{bucket}")
        if not connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be a positive number of seconds, got "
                              f"{connect_timeout!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.connect_timeout = float(connect_timeout)
        self._timeout = timeout
        self._endpoint = _endpoint()
        self._client = client if client is not None else self._make_client(
            max_workers=max_workers, read_timeout=timeout, attempts=10)
        if check_bucket:
            self._check_bucket()
            self._check_conditional_writes()

    # -- the client ----------------------------------------------------------------------

    def _make_client(self, *, max_workers: int, read_timeout: float, attempts: int,
                     connect_timeout: float = 10.0) -> Any:
        s3_options = {"addressing_style": "path"} if self._endpoint else {}
        config = Config(retries={"mode": "standard", "max_attempts": attempts},
                        max_pool_connections=max(10, max_workers), connect_timeout=connect_timeout,
                        read_timeout=read_timeout, s3=s3_options)
        session = boto3.session.Session()
        region = session.region_name or ("us-east-1" if self._endpoint else None)
        if region is None:
            raise ConfigError(f"no AWS region for {self.url}: set AWS_REGION (the bucket's "
                              "region) or a region in the AWS profile")
        try:
            client = session.client("s3", region_name=region, endpoint_url=self._endpoint,
                                    config=config)
        except (bexc.BotoCoreError, ValueError) as e:
            raise ConfigError(f"cannot make an S3 client for {self.url}: {e}") from e
        if attempts > 1:
            # Before botocore's own handler, which answers for everything else.
            client.meta.events.register_first("needs-retry.s3",
                                              retry_too_many_requests(max_attempts=attempts))
        return client

    def _check_bucket(self) -> None:
        """The first contact: list one name, retrying transient failures with backoff for at
        most :attr:`connect_timeout` seconds in all, then :class:`StoreUnreachable`."""
        started = time.monotonic()
        deadline = started + self.connect_timeout
        delay, tries = _CONTACT_FIRST_DELAY, 0
        # One client for the contact (making one costs tens of ms), without retries of its
        # own: this loop retries within the bound.
        per_request = min(_CONTACT_REQUEST_TIMEOUT, self.connect_timeout)
        contact = self._make_client(max_workers=1, read_timeout=per_request, attempts=1,
                                    connect_timeout=per_request)
        try:
            while True:
                tries += 1
                try:
                    contact.list_objects_v2(Bucket=self.bucket, Prefix=self._key(""),
                                            MaxKeys=1)
                    return
                except bexc.NoCredentialsError as e:
                    raise self._no_credentials(e) from e
                except bexc.ClientError as e:
                    if _code(e) == "NoSuchBucket":
                        raise self._missing_bucket() from None
                    if not (_code(e) in _TRANSIENT_CODES or _status(e) >= 500):
                        raise self._store_error("listing", "", e) from e
                    failure: BaseException = e
                except (*_NETWORK, bexc.BotoCoreError) as e:
                    failure = e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._unreachable(failure, tries=tries,
                                            elapsed=time.monotonic() - started)
                time.sleep(min(delay, left))
                delay = min(delay * 2, _CONTACT_MAX_DELAY)
                left = deadline - time.monotonic()
                if left < per_request:  # the last request gets what is left of the bound
                    contact.close()
                    per_request = max(0.5, left)
                    contact = self._make_client(max_workers=1, read_timeout=per_request,
                                                attempts=1, connect_timeout=per_request)
        finally:
            contact.close()

    def _check_conditional_writes(self) -> None:
        """Refuse an endpoint that accepts a second ``If-None-Match: *`` create of one name
        (the slot log's fencing rests on it). Once per endpoint and bucket in a process."""
        where = (self._endpoint or "aws", self.bucket)
        with _probe_lock:
            if where not in _probed:
                _probed[where] = self._probe_conditional_writes()
            problem = _probed[where]
        if problem:
            raise ConfigError(problem)

    def _probe_conditional_writes(self) -> str | None:
        name = f"{SCRATCH_PREFIX}if-none-match-probe-{uuid.uuid4().hex}"
        try:
            self.create(name, b"first")
        except StoreError as e:  # credentials that may only read: writes fail anyway
            log.debug("cairn: could not probe %s for If-None-Match (%s)", self.url, e)
            return None
        try:
            try:
                self._put(name, b"second", token=uuid.uuid4().hex)
            except AlreadyExists:
                return None
            except StoreError as e:
                log.debug("cairn: could not probe %s for If-None-Match (%s)", self.url, e)
                return None
            return (f"the S3 endpoint {self._endpoint or 'of Amazon S3'} ignores If-None-Match "
                    f"(a second create-only write of one name in {self.url} succeeded): two "
                    "tries could both think they own a snapshot. Use an endpoint that enforces "
                    "conditional writes (Amazon S3, MinIO >= RELEASE.2024-11-07, Ceph >= 19)")
        finally:
            with contextlib.suppress(StoreError):
                self.delete(name)

    # -- names and errors ----------------------------------------------------------------

    def _key(self, name: str) -> str:
        return prefixed(self.prefix, name)

    _check_name = staticmethod(check_object_name)

    def _missing_bucket(self) -> ConfigError:
        return ConfigError(f"bucket {self.bucket!r} does not exist (store {self.url}); create it "
                           f"with `aws s3 mb s3://{self.bucket}` or fix the store URL")

    def _no_credentials(self, e: BaseException) -> ConfigError:
        return ConfigError(f"no AWS credentials for {self.url}: use IRSA or EKS Pod Identity, an "
                           "instance role, AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                           f"AWS_SECRET_ACCESS_KEY ({e})")

    def _unreachable(self, e: BaseException, *, tries: int, elapsed: float) -> StoreUnreachable:
        text = str(e)
        lowered = text.lower()
        if isinstance(e, (bexc.ConnectTimeoutError, bexc.ReadTimeoutError, TimeoutError)):
            reason = "timed out"
        elif "connection refused" in lowered or "could not connect" in lowered:
            reason = "connection refused"
        elif "name or service not known" in lowered or "name resolution" in lowered:
            reason = "the host name does not resolve"
        elif isinstance(e, bexc.ClientError):
            reason = f"the server answers {_status(e) or _code(e)}"
        else:
            reason = type(e).__name__
        return StoreUnreachable(
            f"cannot reach the store {self.url} at {self._endpoint or 'Amazon S3'}: {reason} "
            f"({tries} {'try' if tries == 1 else 'tries'} in {elapsed:.1f} s; the last: "
            f"{text[:400]}). Check the store is reachable from this worker (network, firewall, "
            "proxy, DNS, AWS_ENDPOINT_URL, the bucket's region), then retry; no try starts "
            "without the store's history of this step", url=self.url, reason=reason)

    def _store_error(self, action: str, name: str, e: BaseException) -> StoreError:
        where = f"{name} in {self.url}" if name else self.url
        if isinstance(e, bexc.ClientError) and (_status(e) == 403 or _code(e) == "AccessDenied"):
            return StoreError(f"{action} {where} was refused ({_code(e)}); the credentials need "
                              "s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on "
                              f"{self.bucket} (and kms:GenerateDataKey and kms:Decrypt on its "
                              "default encryption key, if that is SSE-KMS)")
        return StoreError(f"{action} {where} failed: {e}")

    @contextlib.contextmanager
    def _errors(self, action: str, name: str) -> Iterator[None]:
        """Map client errors to cairn's: 404 → NotFound, anything else → StoreError.

        Callers catch 412 themselves first: what it means depends on the call."""
        try:
            yield
        except CairnError:
            raise
        except bexc.NoCredentialsError as e:
            raise self._no_credentials(e) from e
        except bexc.ClientError as e:
            if _code(e) == "NoSuchBucket":
                raise self._missing_bucket() from None
            if _code(e) in ("NoSuchKey", "404", "NotFound") or _status(e) == 404:
                raise NotFound(f"{name} does not exist in {self.url}") from None
            raise self._store_error(action, name, e) from e
        except (bexc.BotoCoreError, OSError) as e:
            raise self._store_error(action, name, e) from e

    def _info(self, name: str, etag: str, size: int, modified: Any) -> ObjectInfo:
        seconds = int(modified.timestamp())
        return ObjectInfo(name=name, size=int(size), version=f"{etag.strip(chr(34))}.{seconds}",
                          updated=float(seconds))

    # -- Backend -------------------------------------------------------------------------

    def create(self, name: str, data: bytes) -> None:
        self._check_name(name)
        self._put(name, data, token=uuid.uuid4().hex)

    def _put(self, name: str, data: bytes | bytearray | memoryview, *, token: str) -> None:
        """One create-only upload; a 409 is retried, a 412 from this upload's own earlier
        attempt (a lost response) is success, any other 412 is :class:`AlreadyExists`."""
        with self._errors("creating", name):
            for attempt in range(_CONFLICT_RETRIES):
                try:
                    if len(data) > MULTIPART_THRESHOLD:
                        self._put_multipart(name, data, token)
                    else:
                        self._client.put_object(
                            Bucket=self.bucket, Key=self._key(name),
                            Body=bytes(data) if isinstance(data, memoryview) else data,
                            IfNoneMatch="*", ChecksumAlgorithm="CRC32",
                            Metadata={_UPLOAD_TOKEN_KEY: token})
                    return
                except bexc.ClientError as e:
                    if _precondition_failed(e):
                        if self._is_own_create(name, token):
                            return
                        raise AlreadyExists(f"{name} already exists in {self.url}") from None
                    if _status(e) != 409 or attempt == _CONFLICT_RETRIES - 1:
                        raise
                    time.sleep(0.05 * 2 ** attempt)

    def _put_multipart(self, name: str, data: bytes | bytearray | memoryview, token: str) -> None:
        key = self._key(name)
        upload = self._client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32",
            Metadata={_UPLOAD_TOKEN_KEY: token})["UploadId"]
        view = memoryview(data)
        try:
            parts = []
            for number, start in enumerate(range(0, len(view), PART_BYTES), start=1):
                part = self._client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number,
                    Body=bytes(view[start:start + PART_BYTES]), ChecksumAlgorithm="CRC32")
                parts.append({"PartNumber": number, "ETag": part["ETag"],
                              "ChecksumCRC32": part.get("ChecksumCRC32")})
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload, IfNoneMatch="*",
                MultipartUpload={"Parts": [{k: v for k, v in p.items() if v is not None}
                                           for p in parts]})
        except BaseException:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise

    def _is_own_create(self, name: str, token: str) -> bool:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
        except bexc.ClientError:
            return False
        return head.get("Metadata", {}).get(_UPLOAD_TOKEN_KEY) == token

    def open_writer(self, name: str) -> BlobWriter:
        self._check_name(name)
        return BufferedWriter(name, lambda data: self._put(name, data, token=uuid.uuid4().hex))

    def read(self, name: str) -> bytes:
        self._check_name(name)
        with self._errors("reading", name):
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(name))
            buffer = bytearray(int(response["ContentLength"]))
            self._fill(name, response, memoryview(buffer), offset=0)
        return bytes(buffer)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        got = self.read_range_into(name, offset, memoryview(buffer))
        return bytes(buffer[:got]) if got < length else bytes(buffer)

    def read_range_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; returns the bytes read (fewer only at the end)."""
        self._check_name(name)
        if offset < 0:
            raise ValueError(f"negative offset reading {name}")
        buffer = buffer.cast("B")
        if len(buffer) == 0:
            self.stat(name)
            return 0
        with self._errors("reading", name):
            try:
                response = self._client.get_object(
                    Bucket=self.bucket, Key=self._key(name),
                    Range=f"bytes={offset}-{offset + len(buffer) - 1}")
            except bexc.ClientError as e:
                if _status(e) == 416 or _code(e) == "InvalidRange":
                    return 0  # at or past the end (a missing object is a 404)
                raise
            length = int(response["ContentLength"])  # fewer than asked at the end
            return self._fill(name, response, buffer[:length], offset=offset)

    def _fill(self, name: str, response: dict[str, Any], buffer: memoryview, *,
              offset: int) -> int:
        """Read ``response``'s body, ``len(buffer)`` bytes of the object from ``offset``, into
        ``buffer``. A body cut off (a reset, a stall past the read timeout) is asked for again
        from where it stopped, of the same object (``If-Match`` its ETag); five tries in a row
        that bring nothing end it."""
        etag, body = response["ETag"], response["Body"]
        filled, fruitless = 0, 0
        while True:
            before = filled
            try:
                while filled < len(buffer):
                    got = _read_some(body, buffer[filled:])
                    if not got:
                        raise bexc.IncompleteReadError(actual_bytes=filled,
                                                       expected_bytes=len(buffer))
                    filled += got
                return filled
            except _NETWORK:
                fruitless = 0 if filled > before else fruitless + 1
                if fruitless >= _BODY_RETRIES:
                    raise
            finally:
                body.close()
            try:
                body = self._client.get_object(
                    Bucket=self.bucket, Key=self._key(name), IfMatch=etag,
                    Range=f"bytes={offset + filled}-{offset + len(buffer) - 1}")["Body"]
            except bexc.ClientError as e:
                if _precondition_failed(e):
                    raise StoreError(f"{name} in {self.url} changed while it was read") from None
                raise

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        # S3 lists in UTF-8 byte order of the full name: after the common prefix, the names'
        # order (they are ASCII), so nothing needs buffering.
        strip = len(self._key(""))
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix))
        with self._errors("listing", prefix or "/"):
            for page in pages:
                for item in page.get("Contents", ()):
                    yield self._info(item["Key"][strip:], item["ETag"], item["Size"],
                                     item["LastModified"])

    def stat(self, name: str) -> ObjectInfo:
        self._check_name(name)
        with self._errors("reading metadata of", name):
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
        return self._info(name, head["ETag"], head["ContentLength"], head["LastModified"])

    def delete(self, name: str, *, if_version: str | None = None) -> None:
        self._check_name(name)
        current = self.stat(name)  # NotFound when absent: S3 answers 204 either way
        condition: dict[str, str] = {}
        if if_version is not None:
            etag, _, seconds = if_version.rpartition(".")
            if not etag or not seconds.isdigit():
                raise ConfigError(f"{if_version!r} is not an S3 object version (ETAG.SECONDS)")
            if current.version != if_version:
                raise PreconditionFailed(f"{name} changed since it was listed; not deleted")
            condition = {"IfMatch": f'"{etag}"'}
        with self._errors("deleting", name):
            try:
                self._client.delete_object(Bucket=self.bucket, Key=self._key(name), **condition)
            except bexc.ClientError as e:
                if _precondition_failed(e):
                    raise PreconditionFailed(f"{name} changed since it was listed; not "
                                             "deleted") from None
                raise

    def touch(self, name: str) -> None:
        """Copy the object onto itself with new metadata: ``LastModified`` moves (S3 accepts
        no self-copy that changes nothing). On a versioned bucket each touch keeps the old
        copy as a noncurrent version: see docs/store-backends.md for the lifecycle rule."""
        self._check_name(name)
        key = self._key(name)
        with self._errors("touching", name):
            self._client.copy_object(
                Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": key},
                MetadataDirective="REPLACE", Metadata={_TOUCH_KEY: uuid.uuid4().hex})

    def close(self) -> None:
        self._client.close()


def _read_some(body: Any, buffer: memoryview) -> int:
    """Read at most 256 KiB of what a response body has next into ``buffer``; 0 at its end.
    (A read that fails keeps nothing of what it got: a body cut off after 1 GiB must not
    lose it all.)"""
    buffer = buffer[:_READ_PIECE]
    readinto = getattr(body, "readinto", None)  # botocore >= 1.36
    if readinto is not None:
        return readinto(buffer)
    data = body.read(len(buffer))
    buffer[:len(data)] = data
    return len(data)


def retry_too_many_requests(*, max_attempts: int) -> Callable[..., float | None]:
    """A ``needs-retry`` handler that retries an HTTP 429 answer (S3-compatible servers and
    proxies send it; S3 throttles with 503 ``SlowDown``). botocore's standard mode retries a
    429 whose error code it does not know only in recent releases (1.44.18 does; 1.35.99, the
    low end of cairn's supported range, failed the first 429: measured,
    ``tests/integration/store/test_s3_specific.py``); with this handler first, every release
    retries alike: full-jitter backoff, never shorter than the answer's ``Retry-After``, at
    most ``max_attempts`` tries in all. Returns the delay in seconds, or None to let
    botocore's handler decide."""

    def needs_retry(attempts: int, response: Any = None, **_: Any) -> float | None:
        http = response[0] if response is not None else None
        if getattr(http, "status_code", None) != 429 or attempts >= max_attempts:
            return None
        delay = random.uniform(0, min(_THROTTLED_MAX_S, _THROTTLED_BASE_S * 2 ** attempts))
        with contextlib.suppress(TypeError, ValueError):
            delay = max(delay, min(_THROTTLED_MAX_S, float(http.headers.get("Retry-After"))))
        log.debug("S3 answered 429 (attempt %d of %d): retrying in %.2f s", attempts,
                  max_attempts, delay)
        return delay

    return needs_retry
