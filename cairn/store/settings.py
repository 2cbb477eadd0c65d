"""A store's format names and the settings of one process's use of it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cairn.exceptions import ConfigError

STORE_FORMAT = "cairn.store/1"
# An encrypted store (ADR 0025): a cairn that predates encryption refuses it by its format.
SEALED_STORE_FORMAT = "cairn.store/1+sealed"
CONFIG_NAME = "cairn-store.json"
DEFAULT_GC_GRACE_SECONDS = 3600.0


#: The transfers one process keeps in flight on a directory of this host: packs written at
#: once, and ranged reads ahead of a restore.
LOCAL_INFLIGHT_PACKS = 4
LOCAL_READ_PREFETCH = 8
LOCAL_IO_THREADS = 8
LOCAL_PACK_BYTES = 32 << 20
#: ... and on a bucket, where each connection is capped by its round trips and the link
#: (bench/store_link_bench.py, 30 ms and 6 MiB/s a connection: 4 in flight reached 0.39-0.46
#: of the cloud libraries' best, 16 of 16 MiB reached 1.22-1.32 for writes, 0.86-0.89 for
#: reads; ADR 0050). 16 packs of 16 MiB is 256 MiB of buffers while a snapshot is written.
REMOTE_INFLIGHT = 16
REMOTE_PACK_BYTES = 16 << 20


@dataclass(frozen=True)
class StoreSettings:
    """Tuning of one process's use of a store (not persisted; safe to vary per process).

    ``pack_bytes``, ``max_inflight_packs``, ``io_threads`` and ``read_prefetch`` left None
    take the defaults of the store's kind when it is opened (:meth:`resolved`): a bucket
    keeps more transfers in flight than a local directory. ``io_threads`` left None is at
    least the other two (each transfer in flight needs a thread)."""

    max_chunk_bytes: int = 1 << 20
    pack_bytes: int | None = None
    max_inflight_packs: int | None = None
    io_threads: int | None = None
    read_prefetch: int | None = None
    keep_last: int = 3

    def __post_init__(self) -> None:
        if not 4096 <= self.max_chunk_bytes <= 256 << 20:
            raise ConfigError("max_chunk_bytes must be between 4 KiB and 256 MiB")
        if self.pack_bytes is not None and self.pack_bytes < self.max_chunk_bytes:
            raise ConfigError("pack_bytes must be at least max_chunk_bytes")
        if self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1; the newest snapshot is always kept")
        counts = (self.io_threads, self.max_inflight_packs, self.read_prefetch)
        if any(n is not None and n < 1 for n in counts):
            raise ConfigError("io_threads, max_inflight_packs and read_prefetch must be >= 1")
        wanted = max((n for n in counts[1:] if n is not None), default=0)
        if self.io_threads is not None and self.io_threads < wanted:
            raise ConfigError(f"io_threads={self.io_threads} would hold max_inflight_packs="
                              f"{self.max_inflight_packs} or read_prefetch={self.read_prefetch} "
                              f"to {self.io_threads} transfers: give io_threads >= {wanted}, "
                              "or leave it unset")

    def resolved(self, *, remote: bool) -> StoreSettings:
        """These settings with the defaults of a bucket (``remote``) or a local directory in
        place of each one left None (no more transfers than the ``io_threads`` given)."""
        cap = self.io_threads or REMOTE_INFLIGHT << 8  # the threads given bound the defaults
        inflight = self.max_inflight_packs or min(
            REMOTE_INFLIGHT if remote else LOCAL_INFLIGHT_PACKS, cap)
        ahead = self.read_prefetch or min(REMOTE_INFLIGHT if remote else LOCAL_READ_PREFETCH, cap)
        threads = self.io_threads or max(REMOTE_INFLIGHT if remote else LOCAL_IO_THREADS,
                                         inflight, ahead)
        packs = self.pack_bytes or max(REMOTE_PACK_BYTES if remote else LOCAL_PACK_BYTES,
                                       self.max_chunk_bytes)
        return replace(self, pack_bytes=packs, max_inflight_packs=inflight, io_threads=threads,
                       read_prefetch=ahead)
