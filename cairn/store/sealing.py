"""Sealing: how an encrypted store encrypts and authenticates what it writes (ADR 0025).

Three kinds of bytes, one AEAD (AES-256-GCM; AES-NI/VAES make it ~8 GB/s a core, far below
BLAKE3's cost):

* **Chunk extents in packs** (a full chunk, a delta's changed pages) are sealed one by one as
  ``ciphertext || tag``; the ciphertext starts where the plaintext would have, so chunks of
  at least 64 KiB still start 4 KiB-aligned for ``O_DIRECT`` (ADR 0016) and the 16-byte tag
  follows. A pack's key is derived from the data key and the pack's name; the nonce is the
  extent's offset in the pack, unique within it, so no nonce repeats under a key. The
  associated data binds the store id. A chunk's *name* is the keyed BLAKE3 of its plaintext
  (a per-store naming key that never rotates, so dedup survives rotation), checked after the
  chunk is decrypted and assembled: a swapped, moved or replayed extent fails its tag, and a
  chunk that decrypts to other content fails its name.
* **Every other object** (slot-log records with their manifests, outcome records, requests,
  parts, an integration's objects) is sealed whole: ``MAGIC || key id || nonce ||
  ciphertext || tag``, a random 96-bit nonce, the associated data binding the store id and
  the object's name, which holds its key path and seq. A record moved to another key or
  seq, copied from another store, or replayed over another name fails.
* The keyring (:mod:`cairn.store.keyring`) is sealed by the key-encryption key instead.

Pack names of an encrypted store end in ``.<key id>``: the data key a pack was sealed with,
which a reader finds in its keyring. Nothing here is secret but the keys.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import blake3

from cairn.exceptions import CorruptSnapshot

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16
NONCE_BYTES = 12
KEY_BYTES = 32
OBJECT_MAGIC = b"cairn\x00s1"
KEY_ID_BYTES = 9  # "k" + 8 hex digits
_HEADER = len(OBJECT_MAGIC) + KEY_ID_BYTES + NONCE_BYTES
_PACK_KEY_CONTEXT = b"cairn pack key/1\x00"


def new_aead(key: bytes) -> AESGCM:
    """AES-256-GCM under ``key``. ``cryptography`` is imported at the first use, so that a run
    on a store that is not encrypted never pays its import (20-45 ms of ``cairn run``'s start
    before a restore)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def invalid_tag() -> type[Exception]:
    """``cryptography``'s authentication failure, imported when first needed (see
    :func:`new_aead`)."""
    from cryptography.exceptions import InvalidTag

    return InvalidTag


class SealBroken(CorruptSnapshot, ValueError):
    """A sealed object or chunk failed authentication (tampered, truncated, from another
    store or key, or not sealed at all in an encrypted store). Never loaded; skipped like a
    corrupt snapshot."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def new_key_id() -> str:
    return "k" + os.urandom(4).hex()


def is_key_id(text: object) -> bool:
    return (isinstance(text, str) and len(text) == KEY_ID_BYTES and text[0] == "k"
            and all(c in "0123456789abcdef" for c in text[1:]))


def pack_key_id(pack: str) -> str | None:
    """The key id a pack's name carries, None for a plaintext store's pack name."""
    _, dot, tail = pack.rpartition(".")
    return tail if dot and is_key_id(tail) else None


@dataclass(frozen=True)
class DataKey:
    id: str
    key: bytes = field(repr=False)


class Sealer:
    """One store's keys in memory: the naming key, every data key of the keyring, and the
    active one new objects are sealed with. Thread-safe (many pool threads seal and open)."""

    def __init__(self, *, store_id: str, naming_key: bytes, keys: dict[str, DataKey],
                 active: str) -> None:
        if active not in keys:
            raise ValueError(f"the active key {active} is not in the keyring")
        self.store_id = store_id
        self.active = keys[active]
        self._keys = dict(keys)
        self._naming_key = naming_key
        self._ad = b"cairn store " + store_id.encode("ascii")
        self._object_aeads = {kid: new_aead(dk.key) for kid, dk in keys.items()}
        self._pack_aeads: dict[str, AESGCM] = {}
        self._lock = threading.Lock()

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    # -- names ----------------------------------------------------------------------------

    def digest(self, data: bytes | bytearray | memoryview) -> str:
        """A chunk's name: the keyed BLAKE3 of its plaintext, as hex."""
        if len(data) >= 512 << 10:
            return blake3.blake3(data, key=self._naming_key,
                                 max_threads=blake3.blake3.AUTO).hexdigest()
        return blake3.blake3(data, key=self._naming_key).hexdigest()

    def pack_suffix(self) -> str:
        return "." + self.active.id

    # -- chunk extents --------------------------------------------------------------------

    def _pack_aead(self, pack: str) -> AESGCM:
        aead = self._pack_aeads.get(pack)
        if aead is not None:
            return aead
        kid = pack_key_id(pack)
        if kid is None:
            raise SealBroken(f"pack {pack} is not sealed, but this store is encrypted: "
                             "it was not written by this store's writers")
        data_key = self._keys.get(kid)
        if data_key is None:
            raise SealBroken(f"pack {pack} is sealed with key {kid}, which the store's keyring "
                             "(as this secret opens it) does not hold")
        derived = blake3.blake3(_PACK_KEY_CONTEXT + pack.encode("ascii"),
                                key=data_key.key).digest()
        aead = new_aead(derived)
        with self._lock:
            if len(self._pack_aeads) > 4096:  # a long-lived process reads many packs
                self._pack_aeads.clear()
            self._pack_aeads[pack] = aead
        return aead

    @staticmethod
    def _nonce(offset: int) -> bytes:
        return offset.to_bytes(NONCE_BYTES, "big")

    def seal_extent_into(self, pack: str, offset: int, plaintext: bytes | memoryview,
                         out: memoryview) -> None:
        """Write ``ciphertext || tag`` of an extent at ``offset`` of ``pack`` into ``out``
        (exactly ``len(plaintext) + TAG_BYTES``; reused memory spares a page fault per page)."""
        self._pack_aead(pack).encrypt_into(self._nonce(offset), plaintext, self._ad, out)

    def open_extent(self, pack: str, offset: int, sealed: bytes | memoryview) -> bytes:
        """The plaintext of ``sealed`` (``ciphertext || tag`` read from ``offset`` of
        ``pack``) as new bytes. Raises :class:`SealBroken`."""
        try:
            return self._pack_aead(pack).decrypt(self._nonce(offset), sealed, self._ad)
        except invalid_tag():
            raise _extent_broken(pack, offset) from None

    def open_extent_into(self, pack: str, offset: int, sealed: memoryview,
                         out: memoryview) -> None:
        """Decrypt ``sealed`` into ``out`` (its plaintext length), which must not overlap
        ``sealed``: cryptography 51 refuses overlapping buffers, and no release documents
        in-place decryption. Raises :class:`SealBroken`."""
        if len(sealed) < TAG_BYTES:
            raise SealBroken(f"the extent at {offset} of pack {pack} is truncated")
        try:
            self._pack_aead(pack).decrypt_into(self._nonce(offset), sealed, self._ad, out)
        except invalid_tag():
            raise _extent_broken(pack, offset) from None

    # -- whole objects --------------------------------------------------------------------

    def _object_ad(self, name: str) -> bytes:
        return self._ad + b"\x00" + name.encode("utf-8")

    def seal_object(self, name: str, data: bytes | memoryview) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        key = self.active
        sealed = self._object_aeads[key.id].encrypt(nonce, data, self._object_ad(name))
        return OBJECT_MAGIC + key.id.encode("ascii") + nonce + sealed

    def open_object(self, name: str, data: bytes) -> bytes:
        """The plaintext of sealed object ``name``; :class:`SealBroken` when it is not sealed
        by this store under a key of its keyring, or was changed, truncated or renamed."""
        if len(data) < _HEADER + TAG_BYTES or not data.startswith(OBJECT_MAGIC):
            raise SealBroken(f"{name} is not sealed, but this store is encrypted: it was not "
                             "written by this store's writers")
        kid = data[len(OBJECT_MAGIC):len(OBJECT_MAGIC) + KEY_ID_BYTES].decode("ascii", "replace")
        aead = self._object_aeads.get(kid)
        if aead is None:
            raise SealBroken(f"{name} is sealed with key {kid}, which the store's keyring (as "
                             "this secret opens it) does not hold")
        nonce = data[len(OBJECT_MAGIC) + KEY_ID_BYTES:_HEADER]
        try:
            return aead.decrypt(nonce, data[_HEADER:], self._object_ad(name))
        except invalid_tag():
            raise SealBroken(f"{name} failed authentication (tampered with, or moved from "
                             "another name, key, seq or store)") from None


def _extent_broken(pack: str, offset: int) -> SealBroken:
    return SealBroken(f"the extent at {offset} of pack {pack} failed authentication "
                      "(tampered with, moved, or from another store)")
