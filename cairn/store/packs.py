"""Packing chunks into pack objects, sealed in the background.

Every chunk lands in a pack: a create-only object of concatenated chunks (default 32 MiB),
named ``packs/<xx>/<random id>``. Packs keep the object count and the number of fsyncs or
requests per GiB small on every backend; the manifest records each chunk's pack and offset.
A chunk of at least :data:`~cairn.store.aligned.DIRECT_IO_MIN` bytes starts at a multiple of
:data:`~cairn.store.aligned.DIRECT_IO_ALIGN`, after zero padding, so that a local restore can
read it with ``O_DIRECT``; readers go by the recorded offsets and never see the padding. In an
encrypted store each chunk is written sealed (:mod:`cairn.store.sealing`): its ciphertext at the
recorded offset, its 16-byte tag right after it, and the pack's name ends in the key's id.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from cairn.store.aligned import DIRECT_IO_ALIGN, DIRECT_IO_MIN
from cairn.store.backend import Backend, BlobWriter
from cairn.store.sealing import TAG_BYTES, Sealer

PACKS_PREFIX = "packs/"
# Chunks this large are encrypted on the pool while the caller goes on; a smaller one costs
# less to encrypt (32 KiB: ~4 us) than to hand to another thread and wait for.
SEAL_ON_POOL_MIN = 256 << 10
_ZEROS = bytes(DIRECT_IO_ALIGN)


def new_pack_name() -> str:
    ident = uuid.uuid4().hex
    return f"{PACKS_PREFIX}{ident[:2]}/{ident}"


class PackWriter:
    """Appends chunks to the current pack; full packs are sealed (committed) on a thread pool.

    ``add`` runs on the caller's thread; at most ``max_inflight`` packs are being sealed at
    once, which bounds memory on backends that buffer a pack. :meth:`flush` returns when every
    pack written so far is durable, and raises the first sealing error.

    In an encrypted store a chunk of at least ``SEAL_ON_POOL_MIN`` bytes is encrypted and
    written on the pool while the caller goes on (hashing the next chunk), one chunk at a time
    and in order: the bytes given to ``add`` must stay unchanged until the next ``add``,
    :meth:`settle` or :meth:`flush` returns (``writes`` counts the chunks handed over).
    """

    def __init__(self, backend: Backend, *, pack_bytes: int, pool: ThreadPoolExecutor,
                 max_inflight: int, sealer: Sealer | None = None) -> None:
        self._backend = backend
        self._sealer = sealer
        self._sealed = bytearray()  # where a chunk is sealed before it is written (reused)
        self._pack_bytes = pack_bytes
        self._pool = pool
        self._slots = threading.Semaphore(max_inflight)
        self._current: BlobWriter | None = None
        # The next pack, opened on the pool while the current one fills: creating a file
        # waits for the filesystem journal, which is busy with the previous pack's fsync.
        self._next: Future[tuple[str, BlobWriter]] | None = None
        self._current_name = ""
        self._current_size = 0
        self._futures: list[Future[None]] = []
        self._writing: Future[None] | None = None  # the chunk being encrypted and written
        self.writes = 0  # chunks handed to the pool so far (an encrypted store)
        self.created: set[str] = set()
        self.padding_bytes = 0  # zero bytes written to align chunks, in every pack so far

    def add(self, data: memoryview | bytes) -> tuple[str, int]:
        """Append one chunk (sealed, in an encrypted store); returns ``(pack name, offset)``."""
        self._raise_failed()
        if self._current is None:
            if self._next is not None:
                future, self._next = self._next, None
                self._current_name, self._current = future.result()
            else:
                self._current_name, self._current = self._open()
            self._current_size = 0
            self.created.add(self._current_name)
        padding = -self._current_size % DIRECT_IO_ALIGN if len(data) >= DIRECT_IO_MIN else 0
        offset = self._current_size + padding
        name = self._current_name
        self.padding_bytes += padding
        if self._sealer is None:
            if padding:
                self._current.write(memoryview(_ZEROS)[:padding])
            self._current.write(data)
            self._current_size = offset + len(data)
        else:
            self._write_sealed(self._current, name, offset, padding, data)
            self._current_size = offset + len(data) + TAG_BYTES
        if self._current_size >= self._pack_bytes:
            self.settle()
            self._seal()
        elif self._next is None and self._current_size >= self._pack_bytes // 2:
            self._next = self._pool.submit(self._open)
        return name, offset

    def _write_sealed(self, writer: BlobWriter, name: str, offset: int, padding: int,
                      data: memoryview | bytes) -> None:
        sealer = self._sealer
        assert sealer is not None
        self.settle()  # one chunk at a time: the order in the pack, and one reused buffer

        def write() -> None:
            size = len(data) + TAG_BYTES
            if len(self._sealed) < size:
                self._sealed = bytearray(size)
            sealed = memoryview(self._sealed)[:size]
            sealer.seal_extent_into(name, offset, data, sealed)  # releases the GIL
            if padding:
                writer.write(memoryview(_ZEROS)[:padding])
            writer.write(sealed)  # every backend's write copies it before returning

        if len(data) < SEAL_ON_POOL_MIN:
            write()
            return
        self._writing = self._pool.submit(write)
        self.writes += 1

    def settle(self) -> None:
        """Wait until the chunk being encrypted and written is in its pack (the memory given
        to the last ``add`` is free again); raises its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _open(self) -> tuple[str, BlobWriter]:
        name = new_pack_name() + (self._sealer.pack_suffix() if self._sealer else "")
        return name, self._backend.open_writer(name)

    def _drop_next(self) -> None:
        future, self._next = self._next, None
        if future is not None:
            try:
                future.result()[1].abort()
            except Exception:  # noqa: BLE001 - it was never used; nothing to lose
                pass

    def _seal(self) -> None:
        writer, self._current = self._current, None
        if writer is None:
            return
        self._slots.acquire()

        def commit() -> None:
            try:
                writer.commit()
            finally:
                self._slots.release()

        self._futures.append(self._pool.submit(commit))

    def _raise_failed(self) -> None:
        # Called for every chunk: keep only pending futures so the check stays O(in flight).
        pending = []
        for future in self._futures:
            if not future.done():
                pending.append(future)
            elif future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        self._futures = pending

    def flush(self) -> None:
        """Seal the open pack and wait until every pack is durable."""
        self.settle()
        self._seal()
        self._drop_next()
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    def abort(self) -> None:
        """Discard the open pack and wait for in-flight seals (their packs become garbage)."""
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - aborting anyway
            pass
        if self._current is not None:
            self._current.abort()
            self._current = None
        self._drop_next()
        for future in self._futures:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - aborting anyway; the first error was raised
                pass
        self._futures = []
