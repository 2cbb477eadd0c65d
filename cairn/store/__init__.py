"""The snapshot store: slot log, manifests, chunks in packs, backends, verify, retention, GC.

This package's names (``__all__``) are public API, for the integrations too; its modules are
not."""

from __future__ import annotations

from cairn.store.keyring import (
    Secret,
    SecretError,
    load_secret_file,
    new_secret,
    secret_from_text,
    secret_text,
    write_secret_file,
)
from cairn.store.keys import Key
from cairn.store.kind import API_VERSION, ConnectionField, Setting, StoreKind
from cairn.store.kinds import store_kind, store_kinds, url_forms
from cairn.store.manifest import ChunkRef, FileEntry, Manifest, SnapshotMode
from cairn.store.outcomes import TrySummary, try_summaries
from cairn.store.slotlog import Record, RecordKind
from cairn.store.attempt import Attempt
from cairn.store.records import Records
from cairn.store.requests import RequestKind
from cairn.store.settings import StoreSettings
from cairn.store.timestamps import format_timestamp, parse_timestamp
from cairn.store.store import (
    RestoreResult,
    SnapshotInfo,
    Store,
    VerifyReport,
)
from cairn.store.writer import SnapshotWriter

__all__ = [
    "API_VERSION",
    "Attempt",
    "ChunkRef",
    "ConnectionField",
    "FileEntry",
    "Key",
    "Manifest",
    "Record",
    "RecordKind",
    "Records",
    "RequestKind",
    "RestoreResult",
    "SnapshotInfo",
    "SnapshotMode",
    "SnapshotWriter",
    "Secret",
    "SecretError",
    "Setting",
    "Store",
    "StoreKind",
    "StoreSettings",
    "TrySummary",
    "VerifyReport",
    "format_timestamp",
    "load_secret_file",
    "new_secret",
    "parse_timestamp",
    "secret_from_text",
    "secret_text",
    "store_kind",
    "store_kinds",
    "try_summaries",
    "url_forms",
    "write_secret_file",
]
