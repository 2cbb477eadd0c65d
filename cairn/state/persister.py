"""Stage, then persist: the staging buffers and the writer process of one state-mode try.

A snapshot copies every tensor into a pre-faulted shared-memory staging buffer
(:class:`~cairn.state.staging.StagingBuffer`) and returns; the writer process
(:mod:`cairn.state.writer_process`) chunks, hashes, dedups and commits it, so training stalls
only for the copy. :meth:`Persister.start` spawns the writer and, on a background thread,
allocates and pre-faults the first buffer while the writer boots, so the first snapshot stalls
no longer than later ones.

The thread that drives the Checkpointer drives its Persister; the warm-up thread touches only
the first buffer and the writer's start, and is joined before a snapshot uses either.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from cairn.exceptions import CairnError
from cairn.state.codec import STATE_SCHEMA, cpu_bytes, flatten, header_of
from cairn.state.distributed import Group
from cairn.state.staging import StagingBuffer, plan
from cairn.state.state_io import with_headroom
from cairn.state.writer_process import WriterProcess
from cairn.store import Key, Store

log = logging.getLogger("cairn.state.checkpointer")


class Persister:
    """The staging buffers (``buffers``: 1, or 2 for double buffering) and the writer process
    of one try of ``key`` (module docstring)."""

    def __init__(self, *, key: Key, buffers: int) -> None:
        self.key = key
        self.writer: WriterProcess | None = None
        self._buffer_count = buffers
        self._buffers: dict[int, StagingBuffer] = {}
        self._warm: threading.Thread | None = None
        self._warm_stop = threading.Event()
        self._warming: StagingBuffer | None = None  # the buffer the warm-up is pre-faulting
        self._copy_pool: ThreadPoolExecutor | None = None
        self._copy_helpers = 0

    def start(self, *, store: Store, attempt: Any, staged: int | None) -> None:
        """Create the writer's handle for ``attempt`` and start preparing for the first
        snapshot, whose staging size is ``staged`` bytes (None: allocated by that snapshot)."""
        parent = attempt.parent
        self.writer = WriterProcess(
            store_url=store.url, key=self.key.components, epoch=attempt.epoch,
            last_seq=attempt.log.last_seq, parent_seq=parent.seq if parent else None,
            settings=dataclasses.asdict(store.settings), secret=store.secret)
        self.writer.spawn()  # here, not on the warm-up thread: see WriterProcess.spawn
        self._warm = threading.Thread(target=self._warm_up, args=(staged,),
                                      name="cairn-warm-up", daemon=True)
        self._warm.start()

    def _warm_up(self, staged: int | None) -> None:
        """On a background thread after restore: allocate and pre-fault the first staging
        buffer (its ``staged`` bytes; the headroom faults in only if the state grows) while
        the writer process boots, then wait until the writer is ready. The first snapshot
        would otherwise pay both in its stall (0.5-2 s per GB of faults on a VM). One thread:
        a second would take a core from training. Stops early when close() asks."""
        assert self.writer is not None
        try:
            if staged is not None and not self._warm_stop.is_set():
                buffer = StagingBuffer(with_headroom(staged), prefault=False)
                self._warming = buffer
                try:
                    done = buffer.prefault(stop=self._warm_stop, nbytes=staged)
                except BaseException:
                    buffer.close()
                    raise
                finally:
                    self._warming = None
                if not done:
                    buffer.close()
                    return
                self._buffers[0] = buffer
                self.writer.register_buffer(0, buffer.fd, buffer.capacity)
            self.writer.start()
        except (CairnError, OSError) as e:
            if not self._warm_stop.is_set():
                log.warning("key %s: could not prepare for the first snapshot ahead of time "
                            "(%s); it will try again", self.key, e)

    def join_warm_up(self) -> None:
        """Wait for the warm-up; a snapshot that comes before it ended helps pre-fault the
        buffer it is about to use (one thread faults while training runs, two now)."""
        if self._warm is not None:
            warming = self._warming
            if warming is not None and not self._warm_stop.is_set():
                warming.help_prefault()
            self._warm.join()
            self._warm = None

    @property
    def pid(self) -> int | None:
        """The writer process's pid (None if it could not be started)."""
        self.join_warm_up()
        return self.writer.pid if self.writer is not None else None

    def stage(self, tree: dict[str, Any], step: int, *, group: Group, skip_when_busy: bool,
              collect: Callable[[], None]) -> bool:
        """Copy the state into a free staging buffer and hand it to the writer process; False
        when every buffer is still persisting and ``skip_when_busy`` (nothing staged).
        ``collect`` takes the writer's reports whenever this waited on it."""
        writer = self.writer
        assert writer is not None
        self.join_warm_up()
        structure, arrays = flatten(tree)
        headers = [header_of(a) for a in arrays]
        slots, total = plan([h.nbytes for h in headers])
        ids = list(range(self._buffer_count))
        part = None
        if group.active:
            # Ranks must agree on the seq, which rank 0 knows only once the last persist ended.
            writer.wait_idle()
            collect()
            seq = group.broadcast([writer.last_seq + 1])[0]
            part = {"seq": seq, "rank": group.rank, "world_size": group.world_size}
        free = next((b for b in ids if not writer.is_busy(b)), None)
        if free is None:
            if skip_when_busy:
                log.info("step %d: previous snapshot still persisting; skipped", step)
                return False
            free = writer.wait_free(ids)
            collect()
        assert free is not None
        buffer = self._buffers.get(free)
        if buffer is None or buffer.capacity < total:
            if buffer is not None:
                buffer.close()
            buffer = StagingBuffer(with_headroom(total))
            self._buffers[free] = buffer
            writer.register_buffer(free, buffer.fd, buffer.capacity)
        on_cpu, on_device = [], []
        for slot, array in zip(slots, arrays):
            if isinstance(array, torch.Tensor) and array.device.type == "cpu":
                on_cpu.append((slot, array))
            elif getattr(array, "is_cuda", False):
                on_device.append((slot, array))
            else:  # numpy arrays (RNG state: small), tensors on other devices
                buffer.write(slot, cpu_bytes(array))
        buffer.copy_cpu_tensors(on_cpu, pool=self._copy_threads(),
                                workers=torch.get_num_threads())
        buffer.copy_tensors(on_device)
        index = {"schema": STATE_SCHEMA, "step": step, "structure": structure,
                 "arrays": [h.to_json() for h in headers]}
        writer.persist(free, step=step, index=index,
                       slots=[(slot.offset, slot.nbytes) for slot in slots], part=part)
        return True

    def _copy_threads(self) -> ThreadPoolExecutor | None:
        """Helpers for the staging copy: as many threads as torch uses, the caller included
        (training is stopped meanwhile, so its cores are free)."""
        wanted = torch.get_num_threads() - 1
        if self._copy_pool is not None and self._copy_helpers != wanted:
            self._copy_pool.shutdown()
            self._copy_pool = None
        if self._copy_pool is None and wanted > 0:
            self._copy_pool = ThreadPoolExecutor(max_workers=wanted,
                                                 thread_name_prefix="cairn-stage")
            self._copy_helpers = wanted
        return self._copy_pool

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every staged snapshot is committed or failed; False on timeout."""
        if self.writer is None:
            return True
        self.join_warm_up()
        return self.writer.wait_idle(timeout)

    def take_results(self) -> Iterable[Any]:
        return self.writer.take_results() if self.writer is not None else ()

    @property
    def fenced(self) -> bool:
        return self.writer is not None and self.writer.fenced

    def stop_warm_up(self) -> None:
        """Closing right after restore: stop preparing for the first snapshot."""
        if self._warm is not None:
            self._warm_stop.set()
            if self.writer is not None:
                self.writer.cancel_start()
            self.join_warm_up()
        if self._copy_pool is not None:
            self._copy_pool.shutdown()
            self._copy_pool = None

    def close(self) -> None:
        """Stop the writer process and free the staging buffers (wait first: see
        :meth:`wait_idle`)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers.clear()
