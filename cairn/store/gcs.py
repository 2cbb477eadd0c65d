"""GCSBackend: objects in a Google Cloud Storage bucket, below an optional prefix.

Object ``name`` is stored as ``PREFIX/name`` (just ``name`` when the prefix is empty).

* **Create-only.** Every create is one multipart upload with ``ifGenerationMatch=0``; GCS
  answers 412 when the name is taken, which becomes :class:`AlreadyExists`. A 200 means the
  object is stored durably. Streaming writers buffer in memory and make the same single
  request on commit, so nothing is visible before it.
* **Integrity.** Uploads carry the body's CRC32C, which GCS checks; the CRC32C the server
  reports back is compared as well. Whole-object reads are checked against the stored CRC32C.
* **Versions.** ``ObjectInfo.version`` is ``"GENERATION.METAGENERATION"``: a re-create gives a
  new generation, a :meth:`~GCSBackend.touch` (a metadata patch) a new metageneration, and a
  conditional delete names both as preconditions.

Credentials: with ``STORAGE_EMULATOR_HOST`` set, anonymous ones against the emulator;
otherwise Application Default Credentials (Workload Identity on GKE), unless ``client=`` is
given. Needs ``storage.objects.{create,get,list,update,delete}`` on the bucket (for example
``roles/storage.objectUser``). Requires google-cloud-storage 3.x.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import time
import uuid
from collections.abc import Iterator

import google.api_core.exceptions as gexc
import google_crc32c
import requests
from google.auth.credentials import AnonymousCredentials
from google.auth.exceptions import DefaultCredentialsError, GoogleAuthError, TransportError
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
from google.cloud.storage.retry import DEFAULT_RETRY
from requests.adapters import HTTPAdapter

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
    Backend,
    BlobWriter,
    BufferedWriter,
    ObjectInfo,
    check_object_name,
    prefixed,
)
from cairn.store.kind_gcs import FORM, bucket_and_prefix
from cairn.store.timestamps import format_timestamp, parse_timestamp

if int(storage.__version__.split(".", 1)[0]) < 3:  # pragma: no cover - depends on the install
    # The create path calls Blob._do_multipart_upload, whose 2.x signature differs.
    raise ImportError(f"cairn needs google-cloud-storage>=3.0, found {storage.__version__}")

# Custom metadata key holding a random token per create: after a retried upload whose first
# response was lost, a 412 from our own earlier attempt is told apart from a real conflict.
_UPLOAD_TOKEN_KEY = "cairn-upload"
_TOUCH_KEY = "cairn-touched"
_LIST_FIELDS = "items(name,size,generation,metageneration,updated{}),nextPageToken"
_EMULATOR_PROJECT = "cairn-emulator"

#: How long the first contact with the bucket (opening the backend: the list of one name) may
#: take in all, retries included, before the store counts as unreachable (ADR 0032). Every
#: later call retries within google-cloud-storage's DEFAULT_RETRY (up to 120 s) as before.
DEFAULT_CONNECT_TIMEOUT = 30.0
_CONTACT_REQUEST_TIMEOUT = 10.0  # one request of the first contact (connect, then each read)
_CONTACT_FIRST_DELAY, _CONTACT_MAX_DELAY = 0.25, 4.0
# What the first contact retries: what DEFAULT_RETRY retries (network errors, 429, 5xx), and
# a failed token fetch (the metadata server on GKE). A 403 or a missing bucket is final.
_TRANSIENT = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
              ConnectionError, TransportError, gexc.TooManyRequests, gexc.InternalServerError,
              gexc.BadGateway, gexc.ServiceUnavailable, gexc.GatewayTimeout)


def _crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode("ascii")


def open_url(url: str, *, create: bool = True,
             connect_timeout: float | None = None) -> GCSBackend:
    """The ``gs`` kind's opener (:mod:`cairn.store.kind_gcs`). A bucket is never created."""
    del create
    bucket, prefix = bucket_and_prefix(url)
    if connect_timeout is None:
        return GCSBackend(bucket, prefix)
    return GCSBackend(bucket, prefix, connect_timeout=connect_timeout)


class GCSBackend(Backend):
    """Objects in ``gs://bucket/prefix``. See the module docstring for the guarantees.

    ``client``: a ready :class:`google.cloud.storage.Client` (the caller keeps ownership and
    closes it). ``max_workers``: how many threads may call at once; it sizes the HTTP
    connection pool so that concurrent calls do not open and drop connections.
    ``check_bucket``: list the bucket once now so that a missing bucket or missing permission
    fails here with :class:`ConfigError` / :class:`StoreError` instead of at the first write,
    and a bucket that cannot be reached within ``connect_timeout`` seconds (retries included)
    with :class:`StoreUnreachable`.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: storage.Client | None = None,
        max_workers: int = 32,
        timeout: float = 60.0,
        check_bucket: bool = True,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"invalid bucket name {bucket!r}; give {FORM}")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self._timeout = timeout
        if not connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be a positive number of seconds, got "
                              f"{connect_timeout!r}")
        self.connect_timeout = float(connect_timeout)
        # fake-gcs-server (v1.54) ignores preconditions on DELETE and keeps `updated` on a
        # metadata patch; see delete() and _info().
        self._emulated = bool(os.environ.get("STORAGE_EMULATOR_HOST"))
        self._list_fields = _LIST_FIELDS.format(",metadata" if self._emulated else "")
        self._owns_client = client is None
        if client is None:
            client = self._make_client()
            self._size_connection_pool(client, max_workers)
        self._client = client
        self._bucket = client.bucket(bucket)
        if check_bucket:
            self._check_bucket()

    def _make_client(self) -> storage.Client:
        if self._emulated:
            return storage.Client(project=_EMULATOR_PROJECT, credentials=AnonymousCredentials())
        try:
            return storage.Client()
        except DefaultCredentialsError as e:
            raise ConfigError(
                f"no Google Cloud credentials for {self.url}: use Workload Identity, set "
                f"GOOGLE_APPLICATION_CREDENTIALS, or run `gcloud auth application-default "
                f"login` ({e})"
            ) from e

    @staticmethod
    def _size_connection_pool(client: storage.Client, max_workers: int) -> None:
        session = client._http
        # requests keeps 10 connections per host by default; more threads than that would
        # open a connection per call and discard it. mTLS sessions carry their own adapter.
        if isinstance(session, requests.Session) and not getattr(session, "is_mtls", False):
            size = max(10, max_workers)
            for scheme in ("https://", "http://"):
                session.mount(scheme, HTTPAdapter(pool_maxsize=size))

    def _missing_bucket(self) -> ConfigError:
        return ConfigError(
            f"bucket {self.bucket_name!r} does not exist (store {self.url}); create it with "
            f"`gcloud storage buckets create gs://{self.bucket_name}` or fix the store URL"
        )

    def _check_bucket(self) -> None:
        """The first contact: list one name, retrying transient failures with backoff for at
        most :attr:`connect_timeout` seconds in all (each request gets what is left, at most
        10 s and at least 0.5 s), then :class:`StoreUnreachable`. DEFAULT_RETRY would keep
        a worker waiting up to 120 s on a store that is not there (85 s measured, ADR 0032)."""
        started = time.monotonic()
        deadline = started + self.connect_timeout
        delay, tries = _CONTACT_FIRST_DELAY, 0
        while True:
            tries += 1
            left = deadline - time.monotonic()
            try:
                # objects.list is a permission the backend needs anyway; buckets.get
                # (exists()) is not granted by the object roles.
                blobs = self._client.list_blobs(
                    self._bucket, prefix=self._key(""), max_results=1, fields="nextPageToken",
                    timeout=max(0.5, min(_CONTACT_REQUEST_TIMEOUT, left)), retry=None,
                )
                list(blobs)
                return
            except gexc.NotFound:
                raise self._missing_bucket() from None
            except _TRANSIENT as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._unreachable(e, tries=tries,
                                            elapsed=time.monotonic() - started) from e
                time.sleep(min(delay, left))
                delay = min(delay * 2, _CONTACT_MAX_DELAY)
            except (gexc.GoogleAPIError, GoogleAuthError, OSError) as e:
                raise self._store_error("listing", "", e) from e

    def _unreachable(self, e: BaseException, *, tries: int, elapsed: float) -> StoreUnreachable:
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
        text = str(e)
        lowered = text.lower()
        if isinstance(e, requests.Timeout) or "timed out" in lowered:
            reason = "timed out"
        elif "connection refused" in lowered:
            reason = "connection refused"
        elif "name or service not known" in lowered or "name resolution" in lowered:
            reason = "the host name does not resolve"
        elif isinstance(e, TransportError):
            reason = "no credentials could be fetched"
        elif isinstance(e, gexc.GoogleAPIError) and getattr(e, "code", None):
            reason = f"the server answers {e.code}"
        else:
            reason = type(e).__name__
        if len(text) > 400:
            text = text[:400] + "..."
        emulator = ", STORAGE_EMULATOR_HOST" if self._emulated else ""
        return StoreUnreachable(
            f"cannot reach the store {self.url} at {endpoint}: {reason} ({tries} "
            f"{'try' if tries == 1 else 'tries'} in "
            f"{elapsed:.1f} s; the last: {text}). Check the store is reachable from this "
            f"worker (network, firewall, proxy, DNS{emulator}, the bucket's location), then "
            "retry; no try starts without the store's history of this step",
            url=self.url, reason=reason)

    # -- names and errors ----------------------------------------------------------------

    def _key(self, name: str) -> str:
        return prefixed(self.prefix, name)

    _check_name = staticmethod(check_object_name)

    def _info(self, name: str, blob: storage.Blob) -> ObjectInfo:
        updated = blob.updated.timestamp() if blob.updated is not None else 0.0
        if self._emulated:
            # fake-gcs-server leaves `updated` alone on a patch, so take the time touch()
            # recorded; GCS itself moves `updated` on every metadata change.
            touched = (blob.metadata or {}).get(_TOUCH_KEY)
            with contextlib.suppress(TypeError, ValueError):
                updated = max(updated, parse_timestamp(touched))
        return ObjectInfo(
            name=name,
            size=int(blob.size or 0),
            version=f"{blob.generation}.{blob.metageneration}",
            updated=updated,
        )

    def _store_error(self, action: str, name: str, e: BaseException) -> StoreError:
        where = f"{name} in {self.url}" if name else self.url
        if isinstance(e, (gexc.Forbidden, gexc.Unauthorized)):
            return StoreError(
                f"{action} {where} was refused ({e.message}); the credentials need "
                f"roles/storage.objectUser on gs://{self.bucket_name}"
            )
        if isinstance(e, DataCorruption):
            return StoreError(f"{action} {where}: data corrupted in transit ({e})")
        return StoreError(f"{action} {where} failed: {e}")

    @contextlib.contextmanager
    def _errors(self, action: str, name: str) -> Iterator[None]:
        """Map client errors to cairn's: 404 → NotFound, anything else → StoreError.

        Callers catch 412 themselves first: what it means depends on the call."""
        try:
            yield
        except CairnError:
            raise
        except gexc.NotFound:
            raise NotFound(f"{name} does not exist in {self.url}") from None
        except (gexc.GoogleAPIError, GoogleAuthError, DataCorruption, InvalidResponse,
                OSError) as e:  # OSError covers requests' and urllib3's network errors
            raise self._store_error(action, name, e) from e

    # -- Backend -------------------------------------------------------------------------

    def create(self, name: str, data: bytes) -> None:
        self._check_name(name)
        data = bytes(data)
        crc = _crc32c_b64(data)
        token = uuid.uuid4().hex
        blob = self._bucket.blob(self._key(name))
        blob.metadata = {_UPLOAD_TOKEN_KEY: token}
        with self._errors("creating", name):
            try:
                # Called directly because the public upload_from_* switch to a resumable
                # upload above 8 MiB (_MAX_MULTIPART_SIZE): that takes several requests, and
                # fake-gcs-server ignores ifGenerationMatch on it. One multipart request is
                # atomic; packs are at most tens of MiB, so resending it whole on retry is fine.
                response = blob._do_multipart_upload(
                    client=self._client,
                    stream=io.BytesIO(data),
                    content_type="application/octet-stream",
                    size=len(data),
                    predefined_acl=None,
                    if_generation_match=0,
                    if_generation_not_match=None,
                    if_metageneration_match=None,
                    if_metageneration_not_match=None,
                    timeout=self._timeout,
                    checksum="crc32c",
                    # Safe to retry: the precondition stops a duplicate, the token spots ours.
                    retry=DEFAULT_RETRY,
                )
            except InvalidResponse as e:
                status = e.response.status_code
                if status == 412:
                    if self._is_own_create(name, token, crc):
                        return
                    raise AlreadyExists(f"{name} already exists in {self.url}") from None
                if status == 404:
                    raise self._missing_bucket() from None
                raise gexc.from_http_status(status, str(e), response=e.response) from e
            stored = response.json()
        if stored.get("crc32c") != crc:
            # GCS rejects a body that does not match the CRC32C sent with it, so this is a
            # last line of defence (and the only one on emulators that do not check).
            self._discard_corrupt(name, stored.get("generation"))
            raise StoreError(
                f"creating {name} in {self.url}: data corrupted in transit (sent CRC32C {crc}, "
                f"stored {stored.get('crc32c')}); the object was removed, retry the write"
            )

    def _is_own_create(self, name: str, token: str, crc: str) -> bool:
        """Whether the object now at ``name`` is the one this create uploaded (a retried
        request whose first response was lost)."""
        blob = self._bucket.get_blob(self._key(name), timeout=self._timeout)
        return (
            blob is not None
            and (blob.metadata or {}).get(_UPLOAD_TOKEN_KEY) == token
            and blob.crc32c == crc
        )

    def _discard_corrupt(self, name: str, generation: str | None) -> None:
        with contextlib.suppress(Exception):
            self._bucket.blob(self._key(name)).delete(
                if_generation_match=int(generation) if generation else None,
                timeout=self._timeout,
            )

    def open_writer(self, name: str) -> BlobWriter:
        self._check_name(name)
        return BufferedWriter(name, lambda data: self.create(name, data))  # create copies it

    def read(self, name: str) -> bytes:
        self._check_name(name)
        with self._errors("reading", name):
            return self._bucket.blob(self._key(name)).download_as_bytes(
                checksum="crc32c", timeout=self._timeout
            )

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        self._check_name(name)
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset or length reading {name}")
        if length == 0:
            self.stat(name)
            return b""
        with self._errors("reading", name):
            try:
                # A range cannot be checked against the object's CRC32C; callers verify
                # what they read (chunk digests).
                return self._bucket.blob(self._key(name)).download_as_bytes(
                    start=offset, end=offset + length - 1, checksum=None, timeout=self._timeout
                )
            except gexc.RequestRangeNotSatisfiable:
                return b""  # offset at or past the end (a missing object is a 404)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        # GCS lists in lexicographic order of the full name, which after removing the
        # common backend prefix is the order of the names: no buffering and sorting needed.
        strip = len(self._key(""))
        blobs = self._client.list_blobs(
            self._bucket, prefix=self._key(prefix), fields=self._list_fields,
            timeout=self._timeout,
        )
        try:
            for blob in blobs:
                yield self._info(blob.name[strip:], blob)
        except gexc.NotFound:  # listing only 404s for the bucket
            raise self._missing_bucket() from None
        except (gexc.GoogleAPIError, GoogleAuthError, OSError) as e:
            raise self._store_error("listing", prefix or "/", e) from e

    def stat(self, name: str) -> ObjectInfo:
        self._check_name(name)
        with self._errors("reading metadata of", name):
            blob = self._bucket.get_blob(self._key(name), timeout=self._timeout)
        if blob is None:
            raise NotFound(f"{name} does not exist in {self.url}")
        return self._info(name, blob)

    def delete(self, name: str, *, if_version: str | None = None) -> None:
        self._check_name(name)
        generation = metageneration = None
        if if_version is not None:
            try:
                generation, metageneration = (int(part) for part in if_version.split("."))
            except ValueError:
                raise ConfigError(
                    f"{if_version!r} is not a GCS object version (GENERATION.METAGENERATION)"
                ) from None
            if self._emulated and self.stat(name).version != if_version:
                # fake-gcs-server v1.54 ignores ifGenerationMatch/ifMetagenerationMatch on
                # DELETE, so check here too. Racy, but real GCS enforces the preconditions
                # sent below atomically; this only keeps emulator runs faithful.
                raise PreconditionFailed(f"{name} changed since it was listed; not deleted")
        with self._errors("deleting", name):
            try:
                self._bucket.blob(self._key(name)).delete(
                    if_generation_match=generation,
                    if_metageneration_match=metageneration,
                    timeout=self._timeout,
                )
            except gexc.PreconditionFailed:
                raise PreconditionFailed(
                    f"{name} changed since it was listed; not deleted"
                ) from None

    def touch(self, name: str) -> None:
        self._check_name(name)
        blob = self._bucket.blob(self._key(name))
        # Any metadata change bumps metageneration and `updated`. The value, the touch time,
        # stands in for `updated` under fake-gcs-server (see _info). Patch merges keys, so
        # the upload token stays.
        blob.metadata = {_TOUCH_KEY: format_timestamp()}
        with self._errors("touching", name):
            # Repeating a touch is harmless, so retry it even without a precondition.
            blob.patch(timeout=self._timeout, retry=DEFAULT_RETRY)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()
