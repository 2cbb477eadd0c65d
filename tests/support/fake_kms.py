"""A FAKE Google Cloud KMS: a real HTTP server speaking the parts of the Cloud KMS v1 REST API
cairn calls (``cryptoKeys.encrypt`` and ``cryptoKeys.decrypt``), so that the real
``google-cloud-kms`` client (its REST transport) is exercised end to end. No KMS can run here.

Each key it knows is an AES-256-GCM key it made; additional authenticated data is bound as
Cloud KMS binds it; CRC32C fields are checked and returned as the service does. It records
every call (method, key, AAD) and can be told to deny a key.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import google_crc32c
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM


def _crc(data: bytes) -> str:
    return str(google_crc32c.value(data))


class FakeKms:
    """``with FakeKms() as kms:`` — ``kms.endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.calls: list[tuple[str, str, bytes]] = []
        self.denied: set[str] = set()
        self.paths: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                status, reply = fake.handle(self.path, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def create_key(self, name: str) -> str:
        self.keys[name] = os.urandom(32)
        return name

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        resource, _, method = path.split("?", 1)[0].removeprefix("/v1/").partition(":")
        self.paths.append(path)
        if resource not in self.keys:
            return 404, {"error": {"code": 404, "status": "NOT_FOUND",
                                   "message": f"CryptoKey {resource} not found."}}
        if resource in self.denied:
            return 403, {"error": {"code": 403, "status": "PERMISSION_DENIED",
                                   "message": "Permission 'cloudkms.cryptoKeyVersions."
                                              "useToEncrypt' denied"}}
        aad = base64.b64decode(body.get("additionalAuthenticatedData", ""))
        self.calls.append((method, resource, aad))
        aead = AESGCM(self.keys[resource])
        if method == "encrypt":
            plaintext = base64.b64decode(body["plaintext"])
            if body.get("plaintextCrc32c") not in (None, _crc(plaintext)):
                return 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT",
                                       "message": "plaintext_crc32c did not match"}}
            nonce = os.urandom(12)
            ciphertext = nonce + aead.encrypt(nonce, plaintext, aad)
            return 200, {"name": f"{resource}/cryptoKeyVersions/1",
                         "ciphertext": base64.b64encode(ciphertext).decode(),
                         "ciphertextCrc32c": _crc(ciphertext), "verifiedPlaintextCrc32c": True,
                         "verifiedAdditionalAuthenticatedDataCrc32c": "additionalAuthenticatedDataCrc32c" in body,
                         "protectionLevel": "SOFTWARE"}
        if method == "decrypt":
            ciphertext = base64.b64decode(body["ciphertext"])
            try:
                plaintext = aead.decrypt(ciphertext[:12], ciphertext[12:], aad)
            except (InvalidTag, ValueError):
                return 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT",
                                       "message": "Decryption failed: the ciphertext is "
                                                  "invalid."}}
            return 200, {"plaintext": base64.b64encode(plaintext).decode(),
                         "plaintextCrc32c": _crc(plaintext), "usedPrimary": True,
                         "protectionLevel": "SOFTWARE"}
        return 404, {"error": {"code": 404, "status": "NOT_FOUND", "message": path}}

    def __enter__(self) -> FakeKms:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
