"""Secrets (key-encryption keys) and an encrypted store's keyring (ADR 0025).

An operator holds a **secret**: a key-encryption key in a file (``cairn secret new PATH``; a
mounted Kubernetes Secret is such a file), never in a pod spec or a store. The store holds
its **keyring** as create-only records ``keyring/<seq>``, each sealed whole by a secret with
AES-256-GCM (associated data: the store id and the record's name) and holding every key the
store has: the naming key (chunk names; never rotates, so dedup survives rotation) and each
data key with its id, the newest being the one new objects are sealed with. Rotation appends
a record with one more data key (optionally sealed by a new secret); old snapshots stay
readable while their key is in the keyring. A bucket writer cannot forge a record without
the secret; deleting the newest records only takes writers back to an older data key. A
secret file may instead name a Google Cloud KMS key (:mod:`cairn.store.kms`): the records are
then wrapped by KMS (envelope encryption) and the file holds no key at all.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Protocol

from cairn.exceptions import AlreadyExists, CairnError, ConfigError, NotFound
from cairn.store.backend import Backend
from cairn.store.sealing import (
    KEY_BYTES,
    NONCE_BYTES,
    DataKey,
    Sealer,
    invalid_tag,
    is_key_id,
    new_aead,
    new_key,
    new_key_id,
)

log = logging.getLogger(__name__)

SECRET_SCHEMA = "cairn.secret/1"
KEYRING_SCHEMA = "cairn.keyring/1"
KEYRING_PREFIX = "keyring/"
_MAX_RECORDS = 10**8


class SecretError(ConfigError):
    """The secret is missing, unreadable, malformed or not this store's. Exit 2; the message
    names the setting to fix."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what} is not text")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{what} is not base64") from None


class KeyEncryptionKey(Protocol):
    """What seals keyring records: a secret file's key (:class:`Secret`) or a Cloud KMS key
    (:class:`cairn.store.kms.KmsSecret`)."""

    id: str
    source: str

    def wrap(self, data: bytes, ad: bytes) -> bytes: ...

    def unwrap(self, blob: bytes, ad: bytes) -> bytes: ...


@dataclass(frozen=True)
class Secret:
    """A key-encryption key: ``id`` names it in keyring records (never the bytes);
    ``source`` says where it came from, for messages."""

    id: str
    key: bytes = field(repr=False)
    source: str = "memory"

    def wrap(self, data: bytes, ad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + new_aead(self.key).encrypt(nonce, data, ad)

    def unwrap(self, blob: bytes, ad: bytes) -> bytes:
        """Raises :class:`cryptography.exceptions.InvalidTag` when ``blob`` is not this
        secret's wrapping of something under ``ad``."""
        return new_aead(self.key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], ad)


def new_secret(*, source: str = "memory") -> Secret:
    return Secret("s" + os.urandom(4).hex(), new_key(), source)


def secret_text(secret: KeyEncryptionKey) -> str:
    """The secret as the text a secret file (or an Airflow connection's extra) holds."""
    if not isinstance(secret, Secret):  # a Cloud KMS key (cairn.store.kms.KmsSecret)
        doc = {"schema": SECRET_SCHEMA, "id": secret.id, "kms": secret.key_name}
        if secret.endpoint:
            doc["endpoint"] = secret.endpoint
        return json.dumps(doc) + "\n"
    assert isinstance(secret, Secret)
    return json.dumps({"schema": SECRET_SCHEMA, "id": secret.id, "key": _b64(secret.key)}) + "\n"


def secret_from_text(text: str, *, source: str) -> Any:
    """Parse what :func:`secret_text` wrote (a :class:`Secret` or a KMS secret);
    :class:`SecretError` naming ``source``."""
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("schema") != SECRET_SCHEMA:
            raise ValueError(f"not a {SECRET_SCHEMA} document")
        if "kms" in doc:
            return _kms_secret(doc, source)
        key = _unb64(doc.get("key"), "key")
        ident = doc.get("id")
        if len(key) != KEY_BYTES or not (isinstance(ident, str) and len(ident) == 9
                                         and ident[0] == "s"):
            raise ValueError("the key or its id is malformed")
    except ValueError as e:
        raise SecretError(f"{source} is not a cairn secret ({e}); write one with "
                          "`cairn secret new PATH`") from None
    return Secret(ident, key, source)


def _kms_secret(doc: dict[str, Any], source: str) -> Any:
    from cairn.store.kms import KmsSecret, check_key_name, kms_secret_id

    try:
        name = check_key_name(doc["kms"])
    except ConfigError as e:
        raise ValueError(str(e)) from None
    endpoint = doc.get("endpoint")
    if endpoint is not None and not (isinstance(endpoint, str) and endpoint):
        raise ValueError("endpoint is not text")
    if doc.get("id") != kms_secret_id(name):
        raise ValueError("its id does not match its KMS key")
    return KmsSecret(kms_secret_id(name), name, endpoint, f"{source} (Cloud KMS key {name})")


def write_secret_file(path: str, *, kms_key: str | None = None,
                      kms_endpoint: str | None = None) -> Any:
    """Create a new secret file at ``path`` (mode 0600, never overwriting one): a new random
    key, or with ``kms_key`` the name of a Cloud KMS key that wraps the keyring."""
    if kms_key is not None:
        from cairn.store.kms import KmsSecret, check_key_name, kms_secret_id

        name = check_key_name(kms_key)
        secret: Any = KmsSecret(kms_secret_id(name), name, kms_endpoint,
                                f"secret file {path} (Cloud KMS key {name})")
    else:
        secret = new_secret(source=f"secret file {path}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SecretError(f"{path} exists; a secret file is never overwritten (losing it loses "
                          "every snapshot sealed with it): choose another path") from None
    except OSError as e:
        raise SecretError(f"cannot create the secret file {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as out:
        out.write(secret_text(secret))
        out.flush()
        os.fsync(out.fileno())
    return secret


def load_secret_file(path: str) -> Any:
    """The secret in file ``path``; :class:`SecretError` naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read(1 << 16)
    except OSError as e:
        raise SecretError(f"cannot read the secret file {path}: {e.strerror}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        log.warning("the secret file %s is readable by every user; chmod 600 it", path)
    return secret_from_text(text, source=f"secret file {path}")


@dataclass(frozen=True)
class Keyring:
    """An encrypted store's keys as the newest keyring record this secret opens."""

    seq: int
    store_id: str
    naming_key: bytes = field(repr=False)
    keys: dict[str, DataKey] = field(repr=False)
    active: str
    secret_id: str
    created: dict[str, str] = field(default_factory=dict)

    def sealer(self) -> Sealer:
        return Sealer(store_id=self.store_id, naming_key=self.naming_key, keys=self.keys,
                      active=self.active)


def record_name(seq: int) -> str:
    return f"{KEYRING_PREFIX}{seq:08d}"


def _ad(store_id: str, name: str) -> bytes:
    return b"cairn keyring " + store_id.encode("ascii") + b"\x00" + name.encode("ascii")


def _encode(keyring: Keyring, secret: KeyEncryptionKey) -> bytes:
    inner = {
        "schema": KEYRING_SCHEMA, "store_id": keyring.store_id, "seq": keyring.seq,
        "naming_key": _b64(keyring.naming_key), "active": keyring.active,
        "keys": [{"id": k.id, "key": _b64(k.key), "created": keyring.created.get(k.id, "")}
                 for k in keyring.keys.values()],
    }
    name = record_name(keyring.seq)
    sealed = secret.wrap(json.dumps(inner).encode("utf-8"), _ad(keyring.store_id, name))
    return json.dumps({"schema": KEYRING_SCHEMA, "secret": secret.id,
                       "sealed": _b64(sealed)}).encode("utf-8")


def _decode(data: bytes, *, seq: int, store_id: str, secret: KeyEncryptionKey) -> Keyring | None:
    """The keyring in record ``seq``; None when another secret sealed it. Raises ValueError
    for a record that is malformed or fails authentication."""
    outer = json.loads(data)
    if not isinstance(outer, dict) or outer.get("schema") != KEYRING_SCHEMA:
        raise ValueError("not a keyring record")
    if outer.get("secret") != secret.id:
        return None
    try:
        plain = secret.unwrap(_unb64(outer.get("sealed"), "sealed"),
                              _ad(store_id, record_name(seq)))
    except invalid_tag():
        raise ValueError("it failed authentication with this secret (tampered with, or "
                         "moved from another seq or store)") from None
    doc: Any = json.loads(plain)
    if doc.get("store_id") != store_id or doc.get("seq") != seq:
        raise ValueError("it belongs to another store or seq")
    keys: dict[str, DataKey] = {}
    created: dict[str, str] = {}
    for entry in doc["keys"]:
        kid = entry["id"]
        key = _unb64(entry["key"], "a data key")
        if not is_key_id(kid) or len(key) != KEY_BYTES:
            raise ValueError("a data key is malformed")
        keys[kid] = DataKey(kid, key)
        created[kid] = str(entry.get("created", ""))
    naming = _unb64(doc["naming_key"], "the naming key")
    if len(naming) != KEY_BYTES or doc["active"] not in keys:
        raise ValueError("the naming key or the active key is malformed")
    return Keyring(seq, store_id, naming, keys, doc["active"], secret.id, created)


def _seqs(backend: Backend) -> list[int]:
    out = []
    for info in backend.list(KEYRING_PREFIX):
        tail = info.name[len(KEYRING_PREFIX):]
        if tail.isdigit() and len(tail) == 8 and info.name == record_name(int(tail)):
            out.append(int(tail))
    return sorted(out)


def load_keyring(backend: Backend, *, store_id: str, secret: KeyEncryptionKey) -> Keyring:
    """The newest keyring record ``secret`` opens. :class:`SecretError` when it opens none
    (the wrong secret): never a fallback to no keys."""
    sealed_by: set[str] = set()
    seqs = _seqs(backend)
    if not seqs:
        raise SecretError(f"the encrypted store {backend.url} has no keyring: it was not made "
                          "by cairn, or its keyring was deleted (its snapshots cannot be read)")
    for seq in reversed(seqs):
        try:
            data = backend.read(record_name(seq))
            keyring = _decode(data, seq=seq, store_id=store_id, secret=secret)
        except NotFound:
            continue
        except (ValueError, KeyError, TypeError) as e:
            if isinstance(e, CairnError):  # KMS refused, or could not be reached: say so
                raise
            log.warning("store %s: skipping keyring record %d: %s", backend.url, seq, e)
            continue
        if keyring is None:
            try:
                sealed_by.add(str(json.loads(data).get("secret")))
            except ValueError:
                pass
            continue
        return keyring
    found = f" (its keyring is sealed with {', '.join(sorted(sealed_by))})" if sealed_by else ""
    raise SecretError(f"the {secret.source} ({secret.id}) does not open the keyring of the "
                      f"encrypted store {backend.url}{found}: wrong secret; give the secret "
                      "the store was created with")


def create_keyring(backend: Backend, *, store_id: str, secret: KeyEncryptionKey, now: str) -> Keyring:
    """Record 1 of a new encrypted store, create-only: AlreadyExists when another process is
    creating the store at the same time (its keyring and config win)."""
    kid = new_key_id()
    keyring = Keyring(1, store_id, new_key(), {kid: DataKey(kid, new_key())}, kid, secret.id,
                      {kid: now})
    backend.create(record_name(1), _encode(keyring, secret))
    return keyring


def rotate_keyring(backend: Backend, keyring: Keyring, *, secret: KeyEncryptionKey, now: str,
                   new_data_key: bool = True) -> Keyring:
    """Append a keyring record sealed by ``secret`` (the same or a new one): with
    ``new_data_key``, a new data key becomes active; old keys stay for reading."""
    seqs = _seqs(backend)
    seq = (seqs[-1] if seqs else keyring.seq) + 1
    if seq >= _MAX_RECORDS:
        raise ConfigError("the keyring has too many records")
    keys = dict(keyring.keys)
    created = dict(keyring.created)
    active = keyring.active
    if new_data_key:
        active = new_key_id()
        keys[active] = DataKey(active, new_key())
        created[active] = now
    rotated = Keyring(seq, keyring.store_id, keyring.naming_key, keys, active, secret.id, created)
    try:
        backend.create(record_name(seq), _encode(rotated, secret))
    except AlreadyExists:
        raise ConfigError("another rotation of this store's keys ran at the same time; "
                          "run it again") from None
    return rotated
