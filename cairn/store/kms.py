"""Google Cloud KMS as the key-encryption key: envelope encryption of the store's keyring.

A KMS secret file names a key, never holds one: ``{"schema": "cairn.secret/1", "id": ...,
"kms": "projects/P/locations/L/keyRings/R/cryptoKeys/K"}`` (``cairn secret new PATH --kms
NAME``). Wrapping a keyring record is one ``Encrypt`` call with the record's associated data
as KMS's additional authenticated data, unwrapping one ``Decrypt``; the data keys themselves
never leave the process, and only principals with ``roles/cloudkms.cryptoKeyEncrypterDecrypter``
on the key can open the store. CRC32C checksums are sent and checked both ways, as Google
recommends. ``endpoint`` (optional) selects another KMS endpoint: a regional or Private Service
Connect one, or, as ``http://HOST:PORT``, an emulator without credentials (the tests' fake).
Needs ``google-cloud-kms`` (the ``kms`` extra).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import blake3
from cryptography.exceptions import InvalidTag

from cairn.exceptions import ConfigError, StoreError

_KEY_NAME_PARTS = ("projects", "locations", "keyRings", "cryptoKeys")


def kms_secret_id(key_name: str) -> str:
    """A KMS secret's id: stable for its key, so keyring records name it."""
    return "s" + blake3.blake3(key_name.encode("utf-8")).hexdigest()[:8]


def check_key_name(key_name: object) -> str:
    parts = key_name.split("/") if isinstance(key_name, str) else []
    if len(parts) != 8 or tuple(parts[0::2]) != _KEY_NAME_PARTS or not all(parts[1::2]):
        raise ConfigError(f"{key_name!r} is not a Cloud KMS key name; give "
                          "projects/P/locations/L/keyRings/R/cryptoKeys/K")
    return key_name  # type: ignore[return-value]


def _crc(data: bytes) -> int:
    import google_crc32c  # with google-cloud-kms (the kms extra)

    return google_crc32c.value(data)


@dataclass(frozen=True)
class KmsSecret:
    """A key-encryption key held by Cloud KMS (the module docstring); used like
    :class:`cairn.store.keyring.Secret`. Thread-safe."""

    id: str
    key_name: str
    endpoint: str | None = None
    source: str = "a Cloud KMS key"
    _state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _client(self) -> Any:
        with self._lock:
            client = self._state.get("client")
            if client is not None:
                return client
            try:
                from google.cloud import kms_v1
            except ImportError:
                raise ConfigError(f"{self.source} needs google-cloud-kms: pip install "
                                  "'cairn-resume[kms]'") from None
            if self.endpoint and self.endpoint.startswith("http://"):
                from google.auth.credentials import AnonymousCredentials
                from google.cloud.kms_v1.services.key_management_service.transports.rest import (
                    KeyManagementServiceRestTransport,
                )

                transport = KeyManagementServiceRestTransport(
                    host=self.endpoint[len("http://"):], url_scheme="http",
                    credentials=AnonymousCredentials())
                client = kms_v1.KeyManagementServiceClient(transport=transport)
            elif self.endpoint:
                client = kms_v1.KeyManagementServiceClient(
                    client_options={"api_endpoint": self.endpoint})
            else:
                client = kms_v1.KeyManagementServiceClient()
            self._state["client"] = client
            return client

    def _call(self, method: str, request: dict[str, Any]) -> Any:
        from google.api_core import exceptions as gexc
        from google.auth.exceptions import GoogleAuthError

        try:
            return getattr(self._client(), method)(request=request, timeout=30)
        except gexc.BadRequest:  # INVALID_ARGUMENT, FAILED_PRECONDITION (over REST: 400)
            raise
        except gexc.Forbidden as e:  # PERMISSION_DENIED (over REST: 403)
            raise ConfigError(f"{self.source}: Cloud KMS refused {method} on {self.key_name} "
                              f"({e.message}); grant roles/cloudkms.cryptoKeyEncrypterDecrypter "
                              "on the key") from None
        except gexc.NotFound:
            raise ConfigError(f"{self.source}: the Cloud KMS key {self.key_name} does not "
                              "exist; check the name in the secret file") from None
        except GoogleAuthError as e:
            raise ConfigError(f"{self.source}: no Google Cloud credentials for Cloud KMS "
                              f"({e}); use Workload Identity or set "
                              "GOOGLE_APPLICATION_CREDENTIALS") from None
        except gexc.GoogleAPIError as e:
            raise StoreError(f"{self.source}: Cloud KMS {method} failed: {e}") from None

    def wrap(self, data: bytes, ad: bytes) -> bytes:
        response = self._call("encrypt", {
            "name": self.key_name, "plaintext": data, "additional_authenticated_data": ad,
            "plaintext_crc32c": _crc(data), "additional_authenticated_data_crc32c": _crc(ad)})
        if not (response.verified_plaintext_crc32c
                and response.verified_additional_authenticated_data_crc32c
                and int(response.ciphertext_crc32c) == _crc(response.ciphertext)):
            raise StoreError(f"{self.source}: Cloud KMS's Encrypt response failed its "
                             "checksums (corrupted in transit); try again")
        return bytes(response.ciphertext)

    def unwrap(self, blob: bytes, ad: bytes) -> bytes:
        """Raises :class:`cryptography.exceptions.InvalidTag` when KMS cannot decrypt ``blob``
        under ``ad`` (another key, another record, tampered)."""
        from google.api_core import exceptions as gexc

        try:
            response = self._call("decrypt", {
                "name": self.key_name, "ciphertext": blob, "additional_authenticated_data": ad,
                "ciphertext_crc32c": _crc(blob), "additional_authenticated_data_crc32c": _crc(ad)})
        except gexc.BadRequest:  # INVALID_ARGUMENT, FAILED_PRECONDITION (over REST: 400)
            raise InvalidTag() from None
        plaintext = bytes(response.plaintext)
        if int(response.plaintext_crc32c) != _crc(plaintext):
            raise StoreError(f"{self.source}: Cloud KMS's Decrypt response failed its "
                             "checksum (corrupted in transit); try again")
        return plaintext
