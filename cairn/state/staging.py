"""Staging buffers: where a snapshot's tensors are copied so training can go on at once.

A buffer is an anonymous memory file (``memfd_create``), so its size is bounded by RAM and the
container's memory limit, not by ``/dev/shm`` (64 MiB by default in containers). The writer
process maps the same file through a descriptor passed over a Unix socket. Buffers are
pre-faulted before the first snapshot uses them (page faults cost more than the copy itself:
about 1 GB/s on a VM), on a background thread when the Checkpointer can size the buffer
early. RAM cost: one buffer is 1× the state's bytes; two (double buffering) are 2×.

This module must not import torch at import time: the writer process imports it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

ALIGN = 64
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without touching them
_PREFAULT_PIECE = 16 << 20  # a stop request (close) is noticed within one piece
_COPY_PIECE_MIN = 1 << 20  # below this a piece is not worth a thread of its own


@dataclass(frozen=True)
class Slot:
    """Where one array lives in a buffer."""

    offset: int
    nbytes: int


def plan(sizes: Sequence[int]) -> tuple[list[Slot], int]:
    """Lay arrays out back to back, each aligned to 64 bytes; returns the slots and the total."""
    slots, offset = [], 0
    for size in sizes:
        slots.append(Slot(offset, size))
        offset += (size + ALIGN - 1) // ALIGN * ALIGN
    return slots, offset


class StagingBuffer:
    """A shared memory buffer of ``capacity`` bytes, pre-faulted unless ``prefault=False``
    (then call :meth:`prefault`). One thread writes it at a time; the writer process reads it
    only while the buffer is handed to it (see the sidecar)."""

    def __init__(self, capacity: int, *, name: str = "cairn-staging",
                 prefault: bool = True) -> None:
        self.capacity = max(capacity, ALIGN)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.capacity)
            self.map = mmap.mmap(self.fd, self.capacity, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._pinned = 0  # the address registered with the CUDA driver, when pinned
        self._bytes: Any = None  # a torch uint8 tensor over the whole map, made on first use
        self._prefaulting: _PrefaultJob | None = None  # while prefault() runs
        if prefault:
            self.prefault()

    def prefault(self, *, stop: threading.Event | None = None, threads: int = 1,
                 nbytes: int | None = None) -> bool:
        """Allocate the pages of the first ``nbytes`` (default: all) now rather than during a
        snapshot's stall; False when ``stop`` was set first (the rest then faults in during
        the first copy). Returns once every page is in, or the stop was seen.

        ``threads`` threads (the caller and ``threads - 1`` helpers), and any thread that
        calls :meth:`help_prefault` meanwhile, take 16 MiB pieces in turn: on a VM one
        thread's faults wait on the hypervisor, and several overlap those waits (1.7 GB on
        the 2-core dev VM: 1.8-3.5 s on one thread, 0.3-2.0 s on two). Uses
        ``MADV_POPULATE_WRITE`` through ctypes, which releases the GIL (so a background
        thread does not hold up training), else writes zeros."""
        end = self.capacity if nbytes is None else max(0, min(nbytes, self.capacity))
        job = _PrefaultJob(self, end, stop)
        self._prefaulting = job
        helpers = [threading.Thread(target=job.work, name="cairn-prefault", daemon=True)
                   for _ in range(max(1, threads) - 1)]
        try:
            for helper in helpers:
                helper.start()
            job.work()
            for helper in helpers:
                helper.join()
            job.wait()  # the pieces a help_prefault caller took
        finally:
            self._prefaulting = None
        return job.finish()

    def help_prefault(self) -> None:
        """From a thread that would otherwise wait for :meth:`prefault` to end (the first
        snapshot's): take pieces of it too. Returns once no piece is left to take; the
        prefault itself returns once every piece taken is in."""
        job = self._prefaulting
        if job is not None:
            job.work()

    def _populate(self, start: int, length: int) -> None:
        """Fault in ``length`` bytes at ``start``, writable."""
        populate = _madvise()
        if populate is not None:
            address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
            if populate(address + start, length, _MADV_POPULATE_WRITE) == 0:
                return
            code = ctypes.get_errno()
            if code != errno.EINVAL:  # out of memory, say: writing zeros would not help
                raise OSError(code, f"pre-faulting the staging buffer: {os.strerror(code)}")
            # A kernel older than 5.14.
        view = memoryview(self.map)
        try:
            view[start:start + length] = bytes(length)
        finally:
            view.release()

    def write(self, slot: Slot, data: memoryview) -> None:
        """Copy ``data`` (exactly ``slot.nbytes``) into the slot."""
        if len(data) != slot.nbytes or slot.offset + slot.nbytes > self.capacity:
            raise ValueError(f"{len(data)} bytes do not fit slot {slot}")
        self.map[slot.offset:slot.offset + slot.nbytes] = data

    def _tensor(self) -> Any:
        import torch

        if self._bytes is None:
            self._bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        return self._bytes

    def copy_cpu_tensors(self, pairs: Sequence[tuple[Slot, Any]], *,
                         pool: ThreadPoolExecutor | None = None, workers: int = 1) -> None:
        """Copy CPU tensors into their slots, each in C order (any layout, 0-dim included).

        The bytes are split evenly among ``workers`` threads of ``pool``: one thread's copy
        does not reach the memory bandwidth of the machine. Contiguous tensors are copied as
        raw bytes by numpy (which releases the GIL and, unlike torch's copy, does not spawn
        its own OpenMP team in every thread); others by torch's strided copy, whole.
        """
        import numpy as np
        import torch

        staging = self._tensor()
        flat = staging.numpy()
        plain: list[tuple[int, Any, int]] = []  # (offset in the buffer, source bytes, size)
        strided: list[tuple[Slot, Any]] = []
        for slot, tensor in pairs:
            if slot.offset + slot.nbytes > self.capacity:
                raise ValueError(f"slot {slot} does not fit a buffer of {self.capacity} bytes")
            if slot.nbytes == 0:
                continue
            tensor = tensor.detach()
            if tensor.is_conj() or tensor.is_neg():
                tensor = tensor.resolve_conj().resolve_neg()
            if tensor.is_contiguous():
                source = tensor.reshape(-1).view(torch.uint8).numpy()
                if source.nbytes != slot.nbytes:
                    raise ValueError(f"{source.nbytes} bytes do not fit slot {slot}")
                plain.append((slot.offset, source, slot.nbytes))
            else:
                strided.append((slot, tensor))
        workers = max(1, min(workers, sum(n for _, _, n in plain) // _COPY_PIECE_MIN or 1))
        shares = _split(plain, workers)

        def copy(share: list[tuple[int, Any, int, int]]) -> None:
            for offset, source, start, end in share:
                np.copyto(flat[offset + start:offset + end], source[start:end])

        def copy_strided(items: list[tuple[Slot, Any]]) -> None:
            for slot, tensor in items:
                target = staging[slot.offset:slot.offset + slot.nbytes].view(tensor.dtype)
                target.view(tensor.shape).copy_(tensor)

        if pool is None or workers == 1:
            copy(shares[0])
            copy_strided(strided)
            return
        futures = [pool.submit(copy, share) for share in shares[1:]]
        try:
            copy(shares[0])
            copy_strided(strided)
        finally:
            for future in futures:
                future.result()  # every byte is in place (or the first error raised)

    def copy_tensors(self, pairs: Sequence[tuple[Slot, object]]) -> None:
        """Copy CUDA tensors into their slots: pinned (page-locked) destination, a side stream,
        and one event the caller's stream waits on; returns once the bytes are in the buffer.

        The buffer is registered with the CUDA driver (``cudaHostRegister``) on first use so the
        device-to-host copies run at full DMA speed.
        """
        import torch

        if not pairs:
            return
        if not self._pinned:
            address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
            status = torch.cuda.cudart().cudaHostRegister(address, self.capacity, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister failed with status {int(status)}")
            self._pinned = address
        staging = self._tensor()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # copy what the model holds right now
        with torch.cuda.stream(stream):
            for slot, tensor in pairs:
                src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # type: ignore[attr-defined]
                staging[slot.offset:slot.offset + slot.nbytes].copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()

    def close(self) -> None:
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = 0
        self._bytes = None  # torch.frombuffer holds an export of the map
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        os.close(self.fd)


class _PrefaultJob:
    """One :meth:`StagingBuffer.prefault` call's pieces, taken in turn by any thread."""

    def __init__(self, buffer: StagingBuffer, end: int, stop: threading.Event | None) -> None:
        self._buffer, self._end, self._stop = buffer, end, stop
        self._next = 0
        self._busy = 0  # pieces taken and not yet in
        self._cond = threading.Condition()
        self._failures: list[BaseException] = []

    def _stopped(self) -> bool:
        return bool(self._failures) or (self._stop is not None and self._stop.is_set())

    def work(self) -> None:
        """Populate pieces until none is left (or a stop or a failure). A failure is kept for
        :meth:`finish`; only KeyboardInterrupt and SystemExit leave from here, on the thread
        they reached (after stopping the others)."""
        while True:
            with self._cond:
                if self._stopped() or self._next >= self._end:
                    return
                start, self._next = self._next, self._next + _PREFAULT_PIECE
                self._busy += 1
            try:
                self._buffer._populate(start, min(_PREFAULT_PIECE, self._end - start))
            except BaseException as e:  # re-raised by the prefault() caller
                with self._cond:
                    self._failures.append(e)
                if not isinstance(e, Exception):
                    raise
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)

    def finish(self) -> bool:
        """True when every piece is in; raises the first failure."""
        if self._failures:
            raise self._failures[0]
        return self._next >= self._end


def _split(plain: list[tuple[int, Any, int]],
           workers: int) -> list[list[tuple[int, Any, int, int]]]:
    """Cut the byte stream of ``plain`` into ``workers`` shares of (nearly) equal size:
    ``(offset, source, start, end)`` pieces, a tensor split where a share ends."""
    total = sum(n for _, _, n in plain)
    quota = -(-total // workers) if total else 1
    shares: list[list[tuple[int, Any, int, int]]] = [[] for _ in range(workers)]
    index, room = 0, quota
    for offset, source, nbytes in plain:
        start = 0
        while start < nbytes:
            take = min(nbytes - start, room) if index < workers - 1 else nbytes - start
            shares[index].append((offset, source, start, start + take))
            start += take
            room -= take
            if room <= 0 and index < workers - 1:
                index, room = index + 1, quota
    return shares


_madvise_fn: Any = None


def _madvise() -> Any:
    """libc's ``madvise`` through ctypes (which releases the GIL), or None."""
    global _madvise_fn
    if _madvise_fn is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise_fn = fn
        except (OSError, AttributeError):
            _madvise_fn = False
    return _madvise_fn or None


def map_shared(fd: int, capacity: int) -> mmap.mmap:
    """Map a buffer received from the trainer, read-only."""
    return mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ)
