"""A store's format names and the settings of one process's use of it."""

from __future__ import annotations

from dataclasses import dataclass

from cairn.exceptions import ConfigError

STORE_FORMAT = "cairn.store/1"
# An encrypted store (ADR 0025): a cairn that predates encryption refuses it by its format.
SEALED_STORE_FORMAT = "cairn.store/1+sealed"
CONFIG_NAME = "cairn-store.json"
DEFAULT_GC_GRACE_SECONDS = 3600.0


@dataclass(frozen=True)
class StoreSettings:
    """Tuning of one process's use of a store (not persisted; safe to vary per process)."""

    max_chunk_bytes: int = 1 << 20
    pack_bytes: int = 32 << 20
    max_inflight_packs: int = 4
    io_threads: int = 8
    read_prefetch: int = 8
    keep_last: int = 3

    def __post_init__(self) -> None:
        if not 4096 <= self.max_chunk_bytes <= 256 << 20:
            raise ConfigError("max_chunk_bytes must be between 4 KiB and 256 MiB")
        if self.pack_bytes < self.max_chunk_bytes:
            raise ConfigError("pack_bytes must be at least max_chunk_bytes")
        if self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1; the newest snapshot is always kept")
        if self.io_threads < 1 or self.max_inflight_packs < 1 or self.read_prefetch < 1:
            raise ConfigError("io_threads, max_inflight_packs and read_prefetch must be >= 1")
