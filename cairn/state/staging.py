"""Staging buffers: where a snapshot's tensors are copied so training can go on at once.

A buffer is an anonymous memory file (``memfd_create``), so its size is bounded by RAM and the
container's memory limit, not by ``/dev/shm`` (64 MiB by default in containers). The writer
process maps the same file through a descriptor passed over a Unix socket. Buffers are
pre-faulted when created so the first snapshot does not pay for page faults. RAM cost: one
buffer is 1× the state's bytes; two (double buffering) are 2×.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

ALIGN = 64


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
    """A pre-faulted shared memory buffer of ``capacity`` bytes. One thread writes it at a time;
    the writer process reads it only while the buffer is handed to it (see the sidecar)."""

    def __init__(self, capacity: int, *, name: str = "cairn-staging") -> None:
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
        self._prefault()

    def _prefault(self) -> None:
        # Writing every page allocates it now rather than during the first snapshot's stall.
        view = memoryview(self.map)
        zeros = bytes(min(self.capacity, 16 << 20))
        for start in range(0, self.capacity, len(zeros)):
            end = min(start + len(zeros), self.capacity)
            view[start:end] = zeros[: end - start]
        view.release()

    def write(self, slot: Slot, data: memoryview) -> None:
        """Copy ``data`` (exactly ``slot.nbytes``) into the slot."""
        if len(data) != slot.nbytes or slot.offset + slot.nbytes > self.capacity:
            raise ValueError(f"{len(data)} bytes do not fit slot {slot}")
        self.map[slot.offset:slot.offset + slot.nbytes] = data

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
            import ctypes

            address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
            status = torch.cuda.cudart().cudaHostRegister(address, self.capacity, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister failed with status {int(status)}")
            self._pinned = address
        staging = torch.frombuffer(self.map, dtype=torch.uint8)
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
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        os.close(self.fd)


def map_shared(fd: int, capacity: int) -> mmap.mmap:
    """Map a buffer received from the trainer, read-only."""
    return mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ)
