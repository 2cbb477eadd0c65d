"""Snapshots of a training state: cairn's Checkpointer against torch.save and torch DCP.

One state, one run. The state is a GPT-2-small-sized model built from ``torch.nn`` layers
(token embedding 50257x768 tied to the output head, positions 1024x768, 12
``nn.TransformerEncoderLayer(768, 12, 3072)`` blocks, final LayerNorm: 124.4 M parameters)
with ``torch.optim.Adam(fused=True)`` after one real training step, so ``exp_avg`` and
``exp_avg_sq`` exist: about 1.49 GB. The optimizer moments are then filled with random
values, as after a long run (after one step the embedding rows of tokens never seen are all
zero, and any dedup would skip them: that would flatter cairn's persist, not measure it).
``--small`` builds a model about 12x smaller (vocabulary 8192, width 384, 4 blocks) for a quick
smoke run. Every contender runs with the same ``torch.set_num_threads(--threads)`` (default 2;
``OMP_NUM_THREADS`` is set to the same for the processes DCP spawns).

What is measured:

* **stall** and **time-to-durable** per snapshot. Stall is the time until training may
  mutate the parameters again; durable is the time until the snapshot survives a crash,
  both from the start of the call (state-dict gathering included on every side).

  - ``cairn`` (``PersistMode.PROCESS``, the default): stall = ``Checkpointer.save(step)``,
    durable = until ``Checkpointer.wait()`` returns;
  - ``cairn_inline`` (``PersistMode.INLINE``): ``save`` returns durable, stall = durable;
  - ``torch_save``: ``torch.save({"model": ..., "optimizer": ...}, path)``, then ``fsync`` of
    the file and its directory; synchronous, so stall = durable;
  - ``dcp_save``: ``torch.distributed.checkpoint.save`` of ``get_state_dict(model, opt)`` to a
    fresh ``FileSystemWriter`` directory (which fsyncs its files); stall = durable;
  - ``dcp_async_*``: ``dcp.async_save`` of the same, durable = until its future (or
    ``AsyncSaveResponse.upload_completion``) completes, stall = until it returns or, when it
    returns an ``AsyncSaveResponse``, until ``staging_completion`` completes. Configurations
    (from torch 2.13's source): ``default`` (thread executor, a fresh
    ``DefaultStager(StagingOptions(False, False, False, False))`` per call, so new staging
    memory every time); ``thread_cached`` (a reused ``DefaultStager``, whose cached staging
    storages are only copied into after the first call); ``process_shm`` (a reused
    ``DefaultStager(StagingOptions(use_shared_memory=True))`` and
    ``async_checkpointer_type=PROCESS``, so a separate process persists from shared memory);
    ``process_shm_async`` (the same with ``use_async_staging=True``). The best of them by
    median stall is ``dcp_best``.

  The first snapshot of each contender is reported separately (DCP allocates its staging
  storages then and, with PROCESS, spawns its process; cairn's Checkpointer starts its
  writer process in ``restore()`` and allocates and pre-faults its staging buffer on a
  background thread after it, so its first snapshot waits only for what is not done yet,
  and helps with it meanwhile). The page population of a fresh buffer of the state's size is
  timed on its own too, on 1 and ``nproc`` threads (median of up to 3), after everything
  else (memory just freed is handed out again fast): what the first snapshot's wait is made
  of.
  Then ``--runs`` snapshots each, rotating the contenders' order every round; before each
  snapshot every tensor of the state is changed (multiplied by 1 + 1e-6, Adam's step
  counters incremented) so that nothing can be deduplicated against the previous snapshot,
  and the page cache is synced and dropped. Each snapshot is durable before the next one
  starts. Median and p95 (linear interpolation) over the runs.
* **memcpy floor**: the time to copy every tensor's bytes into a pre-faulted memfd buffer
  (:class:`cairn.state.staging.StagingBuffer`) with numpy, the bytes split evenly among 1
  thread and among ``nproc`` threads; median of ``--runs`` copies each, and the floor is the
  faster of the two (cairn's own copy is split over ``--threads`` threads).
* **restore**, cold page cache before every side: cairn's verified restore (a fresh model and
  optimizer, ``Checkpointer(store=..., key=...).restore(model=, optimizer=)``, which checks
  every chunk's BLAKE3), ``torch.load(weights_only=True)`` + ``load_state_dict`` on both,
  ``torch.load(mmap=True, weights_only=True)`` + ``load_state_dict`` (the file is mapped and
  read as ``load_state_dict`` copies it), and ``get_state_dict`` + ``dcp.load`` +
  ``set_state_dict``. Every side's time ends with the state ready to train: one byte of
  every page is read after the restore call (``fault_in``; the time until then is reported
  as *resident*), then written back unchanged (``write_in``), because
  ``optimizer.load_state_dict`` keeps tensors that already have the parameter's dtype and
  device, so after ``torch.load(mmap=True)`` Adam's moments (two thirds of the bytes) are
  still unread ``MAP_PRIVATE`` file mappings: the first training step faults them in and,
  as ``optimizer.step()`` updates them in place, copies every page into private memory
  (on the dev VM, 2026-12-04: 0.54-0.60 s in restores run back to back, 0.68-2.97 s in a
  full run, where its page copies met memory the guest had handed back to the host); for
  the other sides both touches cost milliseconds. All restore the same state (saved last,
  unchanged);
  ``restore_vs_torch_load`` is against the faster ``torch.load`` form when ready, and
  ``restore_vs_torch_load_resident`` against the faster one when resident. Each restore runs in
  a fresh process, as a retried task would: it builds the model and an empty optimizer,
  drops the page cache, waits ``--settle`` seconds (default 4), then times the restore
  alone; the parent checks a digest of the restored model and optimizer against the live
  ones. Why fresh processes and the pause: the memory a
  restore fills decides its time on a VM like the 2-core dev VM, where touching memory the
  guest freed seconds ago costs about 1.3 s per GB (free page reporting hands it back to the
  host) while memory the process freed a moment ago costs next to nothing. In one process,
  a side that runs right after itself reuses its own freed heap (``torch.load`` measured 1.0 s
  that way against 2.8-4.4 s after another side), so the rotation, not the reader, decided
  the figure.
* **restore, then train**: ``--first-step-runs`` more restores per side (default 3), each in
  a fresh process from a cold page cache, followed at once by two real training steps
  (batch ``--batch`` x ``--seq``, a seed set after the restore), each timed, with nothing
  touched in between: the end point ``write_in`` stands in for, measured.
  ``restore_first_step_vs_torch_load`` is cairn's restore + first step against the faster
  ``torch.load`` form's (median of the runs; no target, a check on the ready end point).
  Every side's two losses must agree with cairn's in the same round, so each restored model
  and optimizer is checked without reading it beforehand.
* **bytes written** for a fine-tune with >= 90% of the parameters (by element count) frozen
  (``requires_grad=False``, Adam over the rest): snapshot, one training step, snapshot; the
  second snapshot's bytes written (``Manifest.bytes_written`` plus ``padding_bytes``, the
  zeros that align large chunks in their packs) against the floor: the bytes of the tensors
  (model, optimizer, torch and numpy RNG states) that changed between the two snapshots.
* **step time**: training steps (batch ``--batch`` x ``--seq`` tokens) with no persist
  against steps taken while the writer process persists a snapshot (the steps that start
  before the persist is done), and the amortized cost: ``--amortize-steps`` steps with a
  snapshot every ``--snapshot-every`` steps (``Checkpointer.step`` with
  ``SnapshotPolicy(every_steps=...)``) against the same number of steps without, run in
  alternating blocks of ``--snapshot-every`` steps with the snapshot in the middle of each
  block so that its persist overlaps training; a block with a snapshot ends when that
  snapshot is durable (a persist still running is waited for inside the timer). The
  Checkpointer is warm (its buffer and writer exist), as in a long run. The writer process
  runs at nice 19: ``persist_windows_s`` (the time from ``save`` until durable while
  training runs) is its time-to-durable under load.

Where time goes: each snapshot's time to durable and each restore is split into parts, timed
on the measuring thread (cairn's by wrapping its functions while the side runs:
:func:`benchenv.timed_attributes`; the peers' by timing their calls), which add up to the
total with ``other``, plus busy time on pool threads (reads, BLAKE3), which overlaps it. The
exact configuration of every peer is printed and is in the JSON (``peers``). ``--quick`` is a
smoke run for the test suite (a tiny model, one run, no DCP PROCESS executor, the restores of
a round in one child process); its figures mean nothing.

All files live in one fresh directory (``--dir``, default a temp dir under /var/tmp), removed
at the end; cairn stores use ``StoreSettings(keep_last=1)`` and are garbage-collected between
snapshots (untimed) to bound disk use. Dropping the page cache needs root; otherwise the
restore figures are marked warm-cache. GB is 10**9 bytes. The last line printed is one JSON
object with every figure, including ``stall_vs_memcpy``, ``stall_vs_dcp_best``,
``restore_vs_torch_load``, ``frozen90_vs_floor``, ``amortized_slowdown`` and
``first_stall_vs_median`` (cairn's first snapshot's stall over its median, at most 2), and the
targets.
The load average at start and end is recorded: on a shared machine other work skews timings.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import cairn.state.checkpointer as checkpointer_module
from benchenv import (  # bench/ is on sys.path when run as a script
    Timers,
    breakdown,
    drop_caches,
    fsync_path,
    loadavg,
    mean_breakdown,
    print_breakdowns,
    print_peers,
    remove,
    store_read_parts,
    store_write_parts,
    timed_attributes,
)
from cairn.state import capture
from cairn.state.checkpointer import Checkpointer, PersistMode, SnapshotPolicy
from cairn.state.staging import StagingBuffer, plan
from cairn.state.writer_process import WriterProcess
from cairn.store import Key, Store, StoreSettings
from cairn import open_store

KEY = Key.parse("bench/state/run")
PAGE = mmap.PAGESIZE
# resident_vs_torch_load_mmap: issue 39 item 5, the restore until every page is resident
# (read only) against torch.load(mmap=True) with every page touched.
TARGETS = {"stall_vs_memcpy": 1.5, "stall_vs_dcp_best": 1.0, "restore_vs_torch_load": 1.0,
           "resident_vs_torch_load_mmap": 1.0, "frozen90_vs_floor": 1.1,
           "amortized_slowdown": 1.10, "first_stall_vs_median": 2.0}
Parts = list[tuple[Any, str, str]]  # what a breakdown times: (owner, attribute, part)


# -- the model and its training ---------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 50257
    context: int = 1024
    width: int = 768
    layers: int = 12
    heads: int = 12
    hidden: int = 3072


FULL = ModelConfig()
SMALL = ModelConfig(vocab=8192, context=256, width=384, layers=4, heads=6, hidden=1536)
QUICK = ModelConfig(vocab=2048, context=64, width=128, layers=2, heads=4, hidden=512)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return QUICK if args.quick else SMALL if args.small else FULL


class GPT(nn.Module):
    """GPT-2-shaped: embeddings, pre-norm transformer blocks, final LayerNorm, tied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(cfg.width, cfg.heads, cfg.hidden, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(length))
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return nn.functional.linear(self.ln_f(x), self.wte.weight)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=True)


class Trainer:
    def __init__(self, model: GPT, opt: torch.optim.Optimizer, cfg: ModelConfig, batch: int,
                 seq: int) -> None:
        self.model, self.opt, self.cfg, self.batch, self.seq = model, opt, cfg, batch, seq

    def step(self) -> float:
        """One training step; returns its loss."""
        idx = torch.randint(0, self.cfg.vocab, (self.batch, self.seq + 1))
        logits = self.model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.cfg.vocab),
                                           idx[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss)

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start


def densify(opt: torch.optim.Optimizer) -> None:
    """Give every moment realistic non-zero values, as after many steps."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for state in opt.state.values():
            state["exp_avg"].normal_(0.0, 1e-3, generator=gen)
            state["exp_avg_sq"].uniform_(1e-8, 1e-6, generator=gen)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for state in opt.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def perturb(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Change every byte-chunk of the state (in place), like a training step but cheaper."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-6)
        for state in opt.state.values():
            for name, value in state.items():
                if name == "step":
                    value.add_(1)
                elif isinstance(value, torch.Tensor):
                    value.mul_(1 + 1e-6)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def byte_view(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def fault_in(model: nn.Module, opt: torch.optim.Optimizer, *, write: bool = False) -> int:
    """Read (``write``: rewrite) one byte of every page of the restored state; returns the
    pages touched. A restore that left tensors mapped from its file (``torch.load(mmap=True)``:
    ``optimizer.load_state_dict`` keeps the loaded tensors when dtype and device already match,
    so Adam's moments stay file-backed) pays its reads here, and with ``write`` the private
    copy of every page that the first ``optimizer.step()`` makes when it updates the moments
    in place (the mapping is ``MAP_PRIVATE``); for state already in private memory this
    costs a few milliseconds."""
    pages = 0
    for t in state_tensors(model, opt):
        if t.numel() == 0:
            continue
        flat = np.frombuffer(byte_view(t), dtype=np.uint8)
        touched = flat[::PAGE]
        pages += len(touched)
        if write:
            touched += 0  # a write fault per page, the bytes unchanged
        else:
            int(touched.sum())
    return pages


# -- environment ------------------------------------------------------------------------------


@contextlib.contextmanager
def stderr_to(path: str) -> Iterator[None]:
    """Route fd 2 to ``path`` (a process spawned meanwhile keeps it: DCP's logs INFO lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


# -- snapshot contenders ----------------------------------------------------------------------


class Contender:
    """One way to snapshot; ``snapshot`` returns (stall seconds, durable seconds) and charges
    the parts of the durable time to ``timers``: its own blocks, and ``parts`` (library
    functions timed while it runs)."""

    name = ""
    config = ""  # the exact configuration, as the output names it
    parts: Parts = []

    def snapshot(self, step: int, timers: Timers) -> tuple[float, float]:
        raise NotImplementedError

    def after(self) -> None:
        """Untimed cleanup after a durable snapshot."""

    def close(self) -> None:
        pass


class CairnContender(Contender):
    def __init__(self, name: str, root: str, model: nn.Module, opt: torch.optim.Optimizer,
                 mode: PersistMode) -> None:
        self.name = name
        self.path = os.path.join(root, name)
        self.store: Store = open_store(self.path, settings=StoreSettings(keep_last=1))
        self.ckpt = Checkpointer(store=self.store, key=KEY, every_steps=10**9, preemption=None,
                                 persist=mode)
        if self.ckpt.restore(model=model, optimizer=opt) != 0:
            raise AssertionError("fresh store should have no snapshot")
        # Private names are timed where the public ones do not show the part; a name that
        # moved is skipped (its time shows as "other").
        self.parts = [(capture, "gather", "gather"),
                      (Checkpointer, "_join_warm_up", "wait_for_warm_up")]
        if mode is PersistMode.PROCESS:
            self.parts += [(StagingBuffer, "copy_cpu_tensors", "stage_copy"),
                           (WriterProcess, "persist", "handoff")]
            self.config = (f"Checkpointer(persist=PROCESS).save + wait(), local store, "
                           f"{torch.get_num_threads()} copy threads")
        else:
            self.parts += store_write_parts()
            self.config = "Checkpointer(persist=INLINE).save, local store"

    def snapshot(self, step: int, timers: Timers) -> tuple[float, float]:
        start = time.perf_counter()
        self.ckpt.save(step)
        staged = time.perf_counter()
        with timers.timing("wait_for_writer"):
            if not self.ckpt.wait():
                raise AssertionError("wait() timed out")
        durable = time.perf_counter()
        if self.ckpt.committed_step != step:
            raise AssertionError(f"{self.name}: step {step} was not committed")
        return staged - start, durable - start

    def after(self) -> None:
        self.store.gc(grace_seconds=0)

    def close(self) -> None:
        self.ckpt.close()
        self.store.close()


class TorchSaveContender(Contender):
    name = "torch_save"
    config = ("torch.save({'model': state_dict(), 'optimizer': state_dict()}) to a file + "
              "fsync of the file and its directory")

    def __init__(self, root: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.dir = os.path.join(root, self.name)
        os.makedirs(self.dir)
        self.model, self.opt = model, opt
        self.last: str | None = None

    def save_to(self, path: str, timers: Timers | None = None) -> None:
        timers = timers or Timers()
        with timers.timing("state_dict"):
            state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        with timers.timing("torch.save"):
            torch.save(state, path)
        with timers.timing("fsync"):
            fsync_path(path)
        with timers.timing("fsync_dir"):
            fsync_path(os.path.dirname(path), directory=True)

    def snapshot(self, step: int, timers: Timers) -> tuple[float, float]:
        path = os.path.join(self.dir, f"step-{step}.pt")
        start = time.perf_counter()
        self.save_to(path, timers)
        seconds = time.perf_counter() - start
        if self.last is not None:
            remove(self.last)
        self.last = path
        return seconds, seconds


def dcp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


class DcpContender(Contender):
    """``dcp.save`` (``asynchronous=False``) or ``dcp.async_save`` in one configuration."""

    def __init__(self, name: str, root: str, model: nn.Module, opt: torch.optim.Optimizer, *,
                 asynchronous: bool, process: bool = False,
                 stager_options: StagingOptions | None = None) -> None:
        self.name = name
        call = "dcp.async_save" if asynchronous else "dcp.save"
        executor = ", AsyncCheckpointerType.PROCESS" if process else \
            ", thread executor" if asynchronous else ""
        stager = f", a reused DefaultStager({stager_options})" if stager_options else \
            ", a fresh DefaultStager per call" if asynchronous else ""
        self.config = (f"torch.distributed.checkpoint: {call} of get_state_dict(model, opt) to "
                       f"a FileSystemWriter directory (its defaults: thread_count=1, "
                       f"sync_files=True){executor}{stager}")
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.root = root
        self.model, self.opt = model, opt
        self.asynchronous, self.process = asynchronous, process
        self.stager = DefaultStager(stager_options) if stager_options is not None else None
        self.last: str | None = None
        self.count = 0

    def snapshot(self, step: int, timers: Timers) -> tuple[float, float]:
        path = os.path.join(self.dir, f"step-{step}")
        guard = stderr_to(os.path.join(self.root, "dcp-process.log")) \
            if self.process and self.count == 0 else contextlib.nullcontext()
        self.count += 1
        with guard:
            start = time.perf_counter()
            with timers.timing("get_state_dict"):
                state = dcp_state(self.model, self.opt)
            if not self.asynchronous:
                with timers.timing("dcp.save"):
                    dcp.save(state, checkpoint_id=path, no_dist=True)
                staged = durable = time.perf_counter()
            else:
                kwargs: dict[str, Any] = {}
                if self.process:
                    kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
                if self.stager is not None:
                    kwargs["async_stager"] = self.stager
                with timers.timing("async_save_call"):
                    result = dcp.async_save(state, checkpoint_id=path, no_dist=True, **kwargs)
                if isinstance(result, AsyncSaveResponse):
                    with timers.timing("wait_for_staging"):
                        result.staging_completion.result()
                    staged = time.perf_counter()
                    with timers.timing("wait_for_upload"):
                        result.upload_completion.result()
                else:
                    staged = time.perf_counter()
                    with timers.timing("wait_for_upload"):
                        result.result()
                durable = time.perf_counter()
        if self.last is not None:
            remove(self.last)
        self.last = path
        return staged - start, durable - start

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def stop_dcp_process() -> None:
    """Terminate the process DCP's PROCESS executor keeps (its __del__ sends TERMINATE)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    if executor._CHECKPOINT_PROCESS is not None:
        executor._CHECKPOINT_PROCESS = None
        gc.collect()


# -- the measurements -------------------------------------------------------------------------


def split_copies(sources: list[np.ndarray], offsets: list[int], threads: int
                 ) -> list[list[tuple[int, np.ndarray]]]:
    """``threads`` lists of (offset, source bytes), each about 1/threads of all the bytes
    (a large tensor is cut between threads: one embedding is a tenth of the state)."""
    share = -(-sum(a.nbytes for a in sources) // threads)
    out: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(threads)]
    index, room = 0, share
    for offset, source in zip(offsets, sources):
        done = 0
        while done < source.nbytes:
            take = min(room, source.nbytes - done)
            out[index].append((offset + done, source[done:done + take]))
            done += take
            room -= take
            if room == 0 and index < threads - 1:
                index, room = index + 1, share
    return out


def memcpy_floor(tensors: list[torch.Tensor], runs: int, threads: int) -> list[float]:
    """Seconds per copy of every tensor's bytes into a pre-faulted memfd buffer, split evenly
    among ``threads`` threads (numpy copies, which release the GIL: one thread's copy does not
    reach the machine's memory bandwidth); ``runs`` copies after a warm-up."""
    sources = [np.frombuffer(byte_view(t), dtype=np.uint8) for t in tensors]
    slots, total = plan([a.nbytes for a in sources])
    buffer = StagingBuffer(total)
    dest = np.frombuffer(buffer.map, dtype=np.uint8)
    work = split_copies(sources, [slot.offset for slot in slots], threads)

    def copy(pieces: list[tuple[int, np.ndarray]], dest: np.ndarray) -> None:
        for offset, source in pieces:
            np.copyto(dest[offset:offset + source.nbytes], source)

    times = []
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-memcpy")
    try:
        for _ in range(runs + 1):  # the first copy is a warm-up
            start = time.perf_counter()
            list(pool.map(copy, work, [dest] * threads))
            times.append(time.perf_counter() - start)
    finally:
        pool.shutdown()
        del dest, work, sources  # the buffer cannot close while numpy holds its memory
        buffer.close()
    return times[1:]


def population_rates(nbytes: int, runs: int) -> dict[int, list[float]]:
    """Seconds to pre-fault a fresh ``nbytes`` memfd staging buffer (what cairn's warm-up does
    for the first snapshot) on 1 and on ``nproc`` threads, ``runs`` buffers each. New memory
    costs what the kernel (and, in a VM, the hypervisor) takes to hand out its pages; the
    first snapshot waits for whatever of it the warm-up has not done yet."""
    out: dict[int, list[float]] = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        out[threads] = []
        for _ in range(runs):
            buffer = StagingBuffer(nbytes, prefault=False)
            try:
                start = time.perf_counter()
                buffer.prefault(threads=threads)
                out[threads].append(time.perf_counter() - start)
            finally:
                buffer.close()
    return out


def snapshot_rounds(contenders: list[Contender], model: nn.Module, opt: torch.optim.Optimizer,
                    runs: int, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {c.name: {"stall": [], "durable": [], "profiles": []}
                                          for c in contenders}
    step = 0
    for round_ in range(runs + 1):
        shift = round_ % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            perturb(model, opt)
            drop_caches()
            timers = Timers()
            with timed_attributes(timers, contender.parts):
                stall, durable = contender.snapshot(step, timers)
            step += 1
            contender.after()
            gc.collect()
            r = results[contender.name]
            if round_ == 0:
                r["first_stall"], r["first_durable"] = stall, durable
                r["first_breakdown"] = breakdown(durable, timers.main, timers.pool)
            else:
                r["stall"].append(stall)
                r["durable"].append(durable)
                r["profiles"].append((durable, timers))
            log(f"  {'first' if round_ == 0 else f'run {round_}'} {contender.name}: "
                f"stall {stall:.3f}s durable {durable:.3f}s")
    return results


RESTORE_SIDES = ("cairn", "torch_load", "torch_load_mmap", "dcp_load")
TRAIN_AFTER_STEPS = 2  # the first pays for what a restore left undone; the second is a step
TRAIN_AFTER_SEED = 7
TORCH_LOADS = ("torch_load", "torch_load_mmap")  # restore_vs_torch_load: the faster of them
RESTORE_PEERS = {
    "cairn": "Checkpointer(store=..., key=...).restore(model=, optimizer=): every chunk's "
             "BLAKE3 checked",
    "torch_load": "torch.load(path, weights_only=True) -> model.load_state_dict + "
                  "optimizer.load_state_dict",
    "torch_load_mmap": "torch.load(path, mmap=True, weights_only=True) -> "
                       "model.load_state_dict + optimizer.load_state_dict (the model's reads "
                       "happen in load_state_dict; the optimizer keeps its moments mapped from "
                       "the file, MAP_PRIVATE: read when first touched, copied into private "
                       "memory when first written)",
    "dcp_load": "get_state_dict + dcp.load (FileSystemReader) + set_state_dict",
}


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """BLAKE3 over the model's and the optimizer's tensors, in parameter order: equal digests
    mean a restore brought back every byte."""
    digest = blake3.blake3()
    for tensor in model.state_dict().values():
        digest.update(byte_view(tensor))
    for group in opt.param_groups:
        for param in group["params"]:
            for _, value in sorted(opt.state[param].items()):
                if isinstance(value, torch.Tensor):
                    digest.update(byte_view(value))
    return digest.hexdigest()


def make_restore(side: str, source: str, target: nn.Module, opt: torch.optim.Optimizer,
                 timers: Timers) -> tuple[Callable[[], None], Parts]:
    """The restore by ``side`` from ``source`` into ``target`` and ``opt``, and the attributes
    its breakdown times."""
    parts: Parts = []
    if side == "cairn":
        # load_state reads and verifies, capture.apply copies into the live objects.
        parts = [(checkpointer_module, "load_state", "read_and_verify"),
                 (capture, "apply", "apply"), (Store, "open_attempt", "open_attempt"),
                 (Checkpointer, "_start_writer", "start_writer"), *store_read_parts()]

        def restore() -> None:
            ckpt = Checkpointer(store=source, key=KEY, every_steps=10**9, preemption=None)
            try:
                ckpt.restore(model=target, optimizer=opt)
            finally:
                with timers.timing("close"):
                    ckpt.close()
    elif side in TORCH_LOADS:
        def restore() -> None:
            with timers.timing("torch.load"):
                state = torch.load(source, weights_only=True, mmap=side == "torch_load_mmap")
            with timers.timing("model.load_state_dict"):
                target.load_state_dict(state["model"])
            with timers.timing("optimizer.load_state_dict"):
                opt.load_state_dict(state["optimizer"])
    else:
        def restore() -> None:
            with timers.timing("get_state_dict"):
                state = dcp_state(target, opt)
            with timers.timing("dcp.load"):
                dcp.load(state, checkpoint_id=source, no_dist=True)
            with timers.timing("set_state_dict"):
                set_state_dict(target, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
    return restore, parts


def settle_cold(args: argparse.Namespace) -> bool:
    """Collect garbage, drop the page cache, wait ``--settle`` s; whether the drop worked."""
    gc.collect()
    cold = drop_caches()
    time.sleep(args.settle)
    return cold


def restore_once(side: str, source: str, args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process (``--restore-child``): build the model and an empty optimizer, drop
    the page cache, wait ``--settle`` s, then time one restore by ``side`` from ``source``."""
    target = GPT(model_config(args))
    opt = make_optimizer(target)
    timers = Timers()
    restore, parts = make_restore(side, source, target, opt, timers)
    cold = settle_cold(args)
    with timed_attributes(timers, parts):
        start = time.perf_counter()
        restore()
        with timers.timing("fault_in"):
            fault_in(target, opt)
        resident = time.perf_counter() - start
        with timers.timing("write_in"):
            fault_in(target, opt, write=True)
        seconds = time.perf_counter() - start
    return {"side": side, "seconds": seconds, "resident_seconds": resident, "cold": cold,
            "digest": state_digest(target, opt),
            "main": timers.main, "pool": timers.pool}


def restore_then_train(side: str, source: str, args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process (``--restore-child --train-after``): as :func:`restore_once`, but
    the restore is followed by ``TRAIN_AFTER_STEPS`` real training steps, each timed, and
    nothing is touched in between: the first step pays whatever the restore left undone.
    The batches come from a seed set after the restore, so every side's losses must agree
    (the parent checks them; reading a digest first would fault the state in)."""
    cfg = model_config(args)
    target = GPT(cfg)
    opt = make_optimizer(target)
    trainer = Trainer(target, opt, cfg, args.batch, args.seq)
    restore, _ = make_restore(side, source, target, opt, Timers())
    cold = settle_cold(args)
    start = time.perf_counter()
    restore()
    restored = time.perf_counter()
    # After the restore: cairn's puts back the snapshot's RNG state, the others do not.
    torch.manual_seed(TRAIN_AFTER_SEED)
    steps_s, losses = [], []
    for _ in range(TRAIN_AFTER_STEPS):
        began = time.perf_counter()
        losses.append(trainer.step())
        steps_s.append(time.perf_counter() - began)
    return {"side": side, "restore_s": restored - start, "steps_s": steps_s, "losses": losses,
            "cold": cold}


def restore_in_child(sides: tuple[str, ...], sources: dict[str, str], flags: list[str]
                     ) -> list[dict[str, Any]]:
    """Run ``restore_once`` (``restore_then_train`` when ``flags`` has ``--train-after``) for
    each side, in order, in one new process."""
    pairs = [f"{side}={sources[side]}" for side in sides]
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--restore-child", *pairs,
                            *flags], capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"restore by {', '.join(sides)} failed (exit {child.returncode}):\n"
                           f"{child.stderr[-3000:]}")
    results = json.loads(child.stdout.strip().splitlines()[-1])
    assert [r["side"] for r in results] == list(sides), results
    return results


def restore_rounds(sources: dict[str, str], live: nn.Module, live_opt: torch.optim.Optimizer,
                   args: argparse.Namespace, log: Callable[[str], None]
                   ) -> tuple[dict[str, list[float]], dict[str, list[float]],
                              dict[str, dict[str, Any]], bool]:
    """``--runs`` restores per side, each in a fresh process as a retried task would be, the
    sides' order rotating every round; every restore's state is checked against the live one.
    Returns each side's seconds until ready to train and until resident, each side's
    breakdown (mean of its runs), and whether every restore started from a cold page cache."""
    expected = state_digest(live, live_opt)
    times: dict[str, list[float]] = {name: [] for name in RESTORE_SIDES}
    resident: dict[str, list[float]] = {name: [] for name in RESTORE_SIDES}
    profiles: dict[str, list[tuple[float, Timers]]] = {name: [] for name in RESTORE_SIDES}
    cold = True
    flags = child_flags(args)
    for run in range(args.runs):
        order, batches = restore_batches(run, args)
        results = [r for batch in batches for r in restore_in_child(batch, sources, flags)]
        for name, result in zip(order, results):
            if result["digest"] != expected:
                raise AssertionError(f"{name}: the restored state differs from the saved one")
            cold = cold and result["cold"]
            times[name].append(result["seconds"])
            resident[name].append(result["resident_seconds"])
            timers = Timers()
            timers.main, timers.pool = result["main"], result["pool"]
            profiles[name].append((result["seconds"], timers))
            log(f"  run {run + 1} restore {name}: {result['seconds']:.3f}s "
                f"(resident after {result['resident_seconds']:.3f}s)")
    return times, resident, {name: mean_breakdown(p) for name, p in profiles.items()}, cold


def restore_batches(run: int, args: argparse.Namespace
                    ) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Round ``run``'s order of the restore sides (rotated by one each round) and the sides
    each child process restores: one each, or, with ``--quick``, all in one process (4 torch
    imports took 30 s of a smoke run)."""
    shift = run % len(RESTORE_SIDES)
    order = RESTORE_SIDES[shift:] + RESTORE_SIDES[:shift]
    return order, [order] if args.quick else [(name,) for name in order]


def child_flags(args: argparse.Namespace) -> list[str]:
    """The options a restore child needs to build the same model and time it alike."""
    flags = ["--threads", str(args.threads), "--settle", str(args.settle),
             "--batch", str(args.batch), "--seq", str(args.seq)]
    if args.quick:
        flags.append("--quick")
    elif args.small:
        flags.append("--small")
    return flags


def first_step_rounds(sources: dict[str, str], args: argparse.Namespace,
                      log: Callable[[str], None]) -> tuple[dict[str, list[dict[str, Any]]], bool]:
    """``--first-step-runs`` rounds of restore-then-train per side, each in a fresh process,
    the sides' order rotating every round. Every side's losses must agree with cairn's in
    the same round (the same state and batches give the same loss; the second step's also
    depends on the restored Adam moments). Returns each side's runs and whether every one
    started from a cold page cache."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RESTORE_SIDES}
    cold = True
    flags = [*child_flags(args), "--train-after"]
    for run in range(args.first_step_runs):
        order, batches = restore_batches(run, args)
        results = {r["side"]: r for batch in batches
                   for r in restore_in_child(batch, sources, flags)}
        expected = results["cairn"]["losses"]
        for name in order:
            result = results[name]
            if not all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
                       for a, b in zip(result["losses"], expected, strict=True)):
                raise AssertionError(f"{name}: losses {result['losses']} after the restore, "
                                     f"cairn's {expected}: the restored states differ")
            cold = cold and result["cold"]
            runs[name].append(result)
            log(f"  run {run + 1} restore + first step {name}: restore {result['restore_s']:.3f}s"
                f", steps " + " ".join(f"{s:.3f}s" for s in result["steps_s"]))
    return runs, cold


def summarize_first_steps(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per side: medians of the restore, of each step, and of restore + first step (the time
    until training has really gone on)."""
    out: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        until = [r["restore_s"] + r["steps_s"][0] for r in results]
        out[name] = {
            "restore_median_s": round(statistics.median(r["restore_s"] for r in results), 4),
            "step_median_s": [round(statistics.median(r["steps_s"][i] for r in results), 4)
                              for i in range(TRAIN_AFTER_STEPS)],
            "restore_and_first_step_median_s": round(statistics.median(until), 4),
            "restore_and_first_step_runs_s": [round(x, 4) for x in until],
        }
    return out


def print_first_step_table(first: dict[str, dict[str, Any]], cold: bool, best: str) -> None:
    label = "restore, then train" + ("" if cold else " [WARM CACHE: could not drop it]")
    print(f"{label:<30} {'restore':>9} {'1st step':>9} {'2nd step':>9} {'restore+1st':>12}"
          f"   restore+1st, runs")
    for name, f in first.items():
        mark = " *" if name == best else ""
        print(f"{name + mark:<30} {f['restore_median_s']:>9.3f} {f['step_median_s'][0]:>9.3f} "
              f"{f['step_median_s'][1]:>9.3f} {f['restore_and_first_step_median_s']:>12.3f}   "
              + " ".join(f"{v:.3f}" for v in f["restore_and_first_step_runs_s"]))
    print("(real training steps right after the restore call, nothing touched in between: the "
          "first pays what the restore left undone; medians; * the faster torch.load form, "
          "which restore_first_step_vs_torch_load uses)")


def frozen_bytes(cfg: ModelConfig, args: argparse.Namespace, root: str) -> dict[str, Any]:
    torch.manual_seed(2)
    model = GPT(cfg)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    # Train the top of the network (the last k parameter tensors), freeze the rest, with k
    # chosen so that the frozen share of the elements is as close to 90% as tensor sizes allow.
    trainable, best_k, best_gap = 0, 0, 1.0
    for k in range(len(params) + 1):
        if k:
            trainable += params[-k].numel()
        gap = abs((total - trainable) / total - 0.9)
        if gap < best_gap:
            best_k, best_gap = k, gap
    for p in params[:len(params) - best_k]:
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    opt = make_optimizer(model)
    trainer = Trainer(model, opt, cfg, args.batch, args.seq)
    trainer.step()
    densify(opt)
    path = os.path.join(root, "frozen90")
    ckpt = Checkpointer(store=path, key=KEY, every_steps=10**9, preemption=None)

    def named_state() -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
        for index, state in opt.state_dict()["state"].items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/{index}/{k}"] = v.detach().clone()
        out["rng/torch"] = torch.get_rng_state().clone()
        out["rng/numpy"] = torch.from_numpy(np.random.get_state()[1].copy())
        return out

    try:
        ckpt.restore(model=model, optimizer=opt)
        before = named_state()
        first = ckpt.save(0, wait=True)
        trainer.step()
        after = named_state()
        second = ckpt.save(1, wait=True)
    finally:
        ckpt.close()
    if first is None or second is None:
        raise AssertionError("frozen snapshots did not commit")
    changed = 0
    for name, tensor in after.items():
        old = before.get(name)
        if old is None or not same_bytes(old, tensor):
            changed += tensor.numel() * tensor.element_size()
    state_bytes = sum(t.numel() * t.element_size() for t in after.values())
    written = second.bytes_written + second.padding_bytes
    return {"frozen_fraction": round(frozen / total, 4), "params": total,
            "state_bytes": state_bytes,
            "first_bytes_written": first.bytes_written + first.padding_bytes,
            "bytes_written": written, "padding_bytes": second.padding_bytes,
            "floor_bytes": changed, "frozen90_vs_floor": round(written / changed, 4)}


def persist_step_slowdown(ckpt: Checkpointer, trainer: Trainer, runs: int, base_steps: int,
                          step0: int, log: Callable[[str], None]) -> dict[str, Any]:
    base: list[float] = []
    during: list[float] = []
    windows: list[float] = []
    step = step0
    for run in range(runs):
        order = ("base", "persist") if run % 2 == 0 else ("persist", "base")
        for side in order:
            if side == "base":
                base += [trainer.timed_step() for _ in range(base_steps)]
                continue
            ckpt.save(step)
            step += 1
            started = time.perf_counter()
            count = 0
            while not ckpt.wait(timeout=0):
                during.append(trainer.timed_step())
                count += 1
            windows.append(time.perf_counter() - started)
            log(f"  run {run + 1}: {count} steps overlapped a persist of at most "
                f"{windows[-1]:.2f}s")
    mean_base = statistics.fmean(base)
    mean_during = statistics.fmean(during) if during else float("nan")
    return {"step_s": round(mean_base, 4), "step_during_persist_s": round(mean_during, 4),
            "persist_step_slowdown": round(mean_during / mean_base, 4),
            "steps_base": len(base), "steps_during_persist": len(during),
            "persist_windows_s": [round(w, 3) for w in windows]}


def amortized(ckpt: Checkpointer, trainer: Trainer, total_steps: int, every: int,
              first_step: int, log: Callable[[str], None]) -> dict[str, Any]:
    ckpt.policy = SnapshotPolicy(every_steps=every, every_seconds=None)
    blocks = math.ceil(total_steps / every)
    with_s = without_s = 0.0
    snapshots = 0
    unfinished = 0
    offset = every // 2  # so that (step + 1) % every == 0 falls in the middle of a block
    step = math.ceil(first_step / every) * every + offset
    for block in range(blocks):
        n = min(every, total_steps - block * every)
        order = ("without", "with") if block % 2 == 0 else ("with", "without")
        for side in order:
            start = time.perf_counter()
            if side == "without":
                for _ in range(n):
                    trainer.step()
                without_s += time.perf_counter() - start
            else:
                for _ in range(n):
                    trainer.step()
                    snapshots += ckpt.step(step)
                    step += 1
                # The block's snapshot counts until it is durable: a persist still running
                # at the block's end is waited for inside the timer.
                if not ckpt.wait(timeout=0):
                    unfinished += 1
                    ckpt.wait()
                with_s += time.perf_counter() - start
        log(f"  block {block + 1}/{blocks}: with {with_s:.1f}s without {without_s:.1f}s")
    return {"steps": total_steps, "snapshot_every": every, "snapshots": snapshots,
            "with_s": round(with_s, 3), "without_s": round(without_s, 3),
            "persists_unfinished_at_block_end": unfinished,
            "amortized_slowdown": round(with_s / without_s, 4)}


# -- main -------------------------------------------------------------------------------------

QUICK_DEFAULTS = {"runs": 1, "first_step_runs": 1, "amortize_steps": 4, "snapshot_every": 2,
                  "step_samples": 1, "settle": 0.0}
FULL_DEFAULTS = {"runs": 5, "first_step_runs": 3, "amortize_steps": 200, "snapshot_every": 50,
                 "step_samples": 3, "settle": 4.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true",
                        help="a ~12x smaller model, for a quick look")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (the test suite runs it): a tiny model, 1 run, 4 "
                             "amortized steps, no settle pause, no DCP PROCESS executor; "
                             "every figure still reported")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed snapshots per contender, and restores per side (default 5)")
    parser.add_argument("--first-step-runs", type=int, default=None,
                        help="restores per side followed by real training steps (default 3; "
                             "0 skips them)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch.set_num_threads for every contender (default 2)")
    parser.add_argument("--dir", default=None,
                        help="parent directory for the bench files (default: a temp dir "
                             "under /var/tmp); a fresh subdirectory is made and removed")
    parser.add_argument("--batch", type=int, default=1, help="training batch (default 1)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--step-samples", type=int, default=None,
                        help="steps per baseline block of the persist slowdown (default 3)")
    parser.add_argument("--amortize-steps", type=int, default=None,
                        help="steps per side of the amortized comparison (default 200: four "
                             "snapshots; with two, one block's noise decides the figure)")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="snapshot interval in steps for the amortized comparison "
                             "(default 50)")
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds between the cache drop and each timed restore (default 4)")
    parser.add_argument("--restore-child", nargs="+", metavar="SIDE=SOURCE",
                        help=argparse.SUPPRESS)  # timed restores, run by restore_in_child
    parser.add_argument("--train-after", action="store_true",
                        help=argparse.SUPPRESS)  # the child trains after its restore
    parser.add_argument("--no-dcp-process", action="store_true",
                        help="skip the dcp_async configurations with a PROCESS executor")
    parser.add_argument("--skip-steps", action="store_true",
                        help="skip the step-time measurements")
    args = parser.parse_args(argv)
    for name, value in (QUICK_DEFAULTS if args.quick else FULL_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.no_dcp_process = True  # its first snapshot alone spawns a process: 15 s here
    if args.runs < 1 or args.threads < 1 or args.snapshot_every < 2 or args.first_step_runs < 0:
        parser.error("--runs and --threads must be >= 1, --snapshot-every >= 2, "
                     "--first-step-runs >= 0")
    return args


def log(text: str) -> None:
    print(text, flush=True)


def make_contenders(root: str, model: nn.Module, opt: torch.optim.Optimizer,
                    args: argparse.Namespace) -> list[Contender]:
    contenders: list[Contender] = [
        CairnContender("cairn", root, model, opt, PersistMode.PROCESS),
        CairnContender("cairn_inline", root, model, opt, PersistMode.INLINE),
        TorchSaveContender(root, model, opt),
        DcpContender("dcp_save", root, model, opt, asynchronous=False),
        DcpContender("dcp_async_default", root, model, opt, asynchronous=True),
        DcpContender("dcp_async_thread_cached", root, model, opt, asynchronous=True,
                     stager_options=StagingOptions(False, False, False, False)),
    ]
    if not args.no_dcp_process:
        contenders += [
            DcpContender("dcp_async_process_shm", root, model, opt, asynchronous=True,
                         process=True, stager_options=StagingOptions(False, True, False, False)),
            DcpContender("dcp_async_process_shm_async", root, model, opt, asynchronous=True,
                         process=True, stager_options=StagingOptions(False, True, True, False)),
        ]
    return contenders


def memcpy_floors(tensors: list[torch.Tensor], runs: int) -> dict[int, list[float]]:
    """The copy at 1 thread and at ``nproc`` threads: the floor is the faster."""
    counts = sorted({1, os.cpu_count() or 1})
    return {threads: memcpy_floor(tensors, runs, threads) for threads in counts}


def restore_sources(root: str, model: nn.Module, opt: torch.optim.Optimizer,
                    saver: TorchSaveContender) -> dict[str, str]:
    """The same state saved once by each restore side's writer (a store of its own for cairn:
    a restore opens a new attempt, which fences the writer of the store it reads)."""
    source = CairnContender("cairn_restore_source", root, model, opt, PersistMode.PROCESS)
    try:
        source.ckpt.save(0, wait=True)
    finally:
        source.close()
    torch_path = os.path.join(root, "restore.pt")
    saver.save_to(torch_path)
    dcp_path = os.path.join(root, "restore-dcp")
    dcp.save(dcp_state(model, opt), checkpoint_id=dcp_path, no_dist=True)
    return {"cairn": source.path, "torch_load": torch_path, "torch_load_mmap": torch_path,
            "dcp_load": dcp_path}


def measure(args: argparse.Namespace, root: str, cfg: ModelConfig, model: GPT,
            opt: torch.optim.Optimizer, trainer: Trainer,
            tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Every measurement, in order; returns the raw results."""
    raw: dict[str, Any] = {}
    contenders: list[Contender] = []
    try:
        state_bytes = sum(t.nbytes for t in tensors)
        raw["memcpy"] = memcpy_floors(tensors, args.runs)
        for threads, times in raw["memcpy"].items():
            median = statistics.median(times)
            log(f"memcpy, {threads} thread(s): {median:.3f}s "
                f"({sum(t.nbytes for t in tensors) / median / 1e9:.2f} GB/s)")
        contenders = make_contenders(root, model, opt, args)
        raw["peers"] = {c.name: c.config for c in contenders}
        log("snapshots:")
        raw["snaps"] = snapshot_rounds(contenders, model, opt, args.runs, log)

        cairn, saver = contenders[0], contenders[2]
        assert isinstance(cairn, CairnContender) and isinstance(saver, TorchSaveContender)
        for c in contenders[1:]:
            c.close()
        stop_dcp_process()
        contenders = [cairn]
        gc.collect()
        sources = restore_sources(root, model, opt, saver)
        gc.collect()
        log("restore (page cache dropped before each):")
        (raw["restores"], raw["restores_resident"], raw["restore_parts"],
         raw["cold"]) = restore_rounds(sources, model, opt, args, log)
        raw["first_steps"], raw["first_steps_cold"] = {}, True
        if args.first_step_runs:
            log("restore, then real training steps (page cache dropped before each):")
            raw["first_steps"], raw["first_steps_cold"] = first_step_rounds(sources, args, log)
        remove(sources["torch_load"])
        remove(sources["dcp_load"])

        raw["steps"] = {}
        if not args.skip_steps:
            log("step time while persisting:")
            trainer.step()  # warm
            step = 10**6
            raw["steps"]["persist"] = persist_step_slowdown(
                cairn.ckpt, trainer, max(1, args.runs // 2 + 1), args.step_samples, step, log)
            log("amortized:")
            raw["steps"]["amortized"] = amortized(cairn.ckpt, trainer, args.amortize_steps,
                                                  args.snapshot_every, 2 * step, log)
        cairn.close()
        contenders = []
        del tensors
        gc.collect()

        log("frozen 90% fine-tune:")
        raw["frozen"] = frozen_bytes(cfg, args, root)
        # Last: the buffers it frees would be recycled, fast, by whatever allocated next.
        raw["populate"] = population_rates(state_bytes, min(args.runs, 3))
        for threads, times in raw["populate"].items():
            log(f"page population of a fresh staging buffer, {threads} thread(s): "
                f"{statistics.median(times):.3f}s")
    finally:
        for c in contenders:
            with contextlib.suppress(Exception):
                c.close()
        stop_dcp_process()
    return raw


# -- the report -------------------------------------------------------------------------------


def summarize_snapshots(snaps: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for name, r in snaps.items():
        summary[name] = {
            "first_stall_s": round(r["first_stall"], 4),
            "first_durable_s": round(r["first_durable"], 4),
            "stall_median_s": round(statistics.median(r["stall"]), 4),
            "stall_p95_s": round(p95(r["stall"]), 4),
            "durable_median_s": round(statistics.median(r["durable"]), 4),
            "durable_p95_s": round(p95(r["durable"]), 4),
            "stall_runs_s": [round(x, 4) for x in r["stall"]],
            "durable_runs_s": [round(x, 4) for x in r["durable"]],
            "breakdown": mean_breakdown(r["profiles"]),  # of the durable time, mean of runs
            "first_breakdown": r["first_breakdown"],
        }
    return summary


def summarize_memcpy(memcpy: dict[int, list[float]], state_bytes: int) -> dict[str, Any]:
    by_threads = {threads: statistics.median(times) for threads, times in memcpy.items()}
    best = min(by_threads, key=lambda threads: by_threads[threads])
    return {"median_s": round(by_threads[best], 4), "threads": best,
            "gbps": round(state_bytes / by_threads[best] / 1e9, 3),
            "by_threads": {str(t): {"median_s": round(by_threads[t], 4),
                                    "p95_s": round(p95(memcpy[t]), 4),
                                    "gbps": round(state_bytes / by_threads[t] / 1e9, 3),
                                    "runs_s": [round(x, 4) for x in memcpy[t]]}
                           for t in memcpy}}


def print_snapshot_table(summary: dict[str, dict[str, Any]], memcpy: dict[str, Any],
                         dcp_best: str) -> None:
    header = (f"{'snapshot':<30} {'1st stall':>9} {'stall med':>9} {'stall p95':>9} "
              f"{'1st dur.':>9} {'dur. med':>9} {'dur. p95':>9}")
    print(header)
    print("-" * len(header))
    for threads, m in memcpy["by_threads"].items():
        mark = " *" if int(threads) == memcpy["threads"] else ""
        label = f"memcpy floor ({threads} thread{'s' if threads != '1' else ''}){mark}"
        print(f"{label:<30} {'':>9} {m['median_s']:>9.3f} {m['p95_s']:>9.3f}"
              f"   {m['gbps']:.2f} GB/s")
    for name, s in summary.items():
        mark = " *" if name == dcp_best else ""
        print(f"{name + mark:<30} {s['first_stall_s']:>9.3f} {s['stall_median_s']:>9.3f} "
              f"{s['stall_p95_s']:>9.3f} {s['first_durable_s']:>9.3f} "
              f"{s['durable_median_s']:>9.3f} {s['durable_p95_s']:>9.3f}")
    print("(* the floor: the faster memcpy; dcp_best: the async configuration with the lowest "
          "median stall)")


def print_restore_table(restores: dict[str, list[float]], resident: dict[str, list[float]],
                        cold: bool, best_load: str) -> None:
    label = "restore" + ("" if cold else " [WARM CACHE: could not drop it]")
    print(f"{label:<30} {'ready med':>9} {'resident':>9}   ready, runs")
    for name, values in restores.items():
        mark = " *" if name == best_load else ""
        print(f"{name + mark:<30} {statistics.median(values):>9.3f} "
              f"{statistics.median(resident[name]):>9.3f}   "
              f"{' '.join(f'{v:.3f}' for v in values)}")
    print("(ready: every page of the state read and written once, as the first optimizer step "
          "writes the moments in place; resident: only read; medians; * the faster torch.load "
          "form when ready, which restore_vs_torch_load uses)")


def print_steps(frozen: dict[str, Any], steps: dict[str, Any]) -> None:
    print(f"frozen {frozen['frozen_fraction'] * 100:.1f}% fine-tune: 2nd snapshot wrote "
          f"{frozen['bytes_written'] / 1e6:.1f} MB (padding {frozen['padding_bytes'] / 1e3:.0f} "
          f"kB); changed tensors {frozen['floor_bytes'] / 1e6:.1f} MB (state "
          f"{frozen['state_bytes'] / 1e6:.1f} MB; 1st snapshot wrote "
          f"{frozen['first_bytes_written'] / 1e6:.1f} MB)")
    if steps:
        ps, am = steps["persist"], steps["amortized"]
        print(f"step {ps['step_s']:.3f}s; while persisting {ps['step_during_persist_s']:.3f}s "
              f"(x{ps['persist_step_slowdown']:.2f}, {ps['steps_during_persist']} steps); "
              f"durable while training within {statistics.median(ps['persist_windows_s']):.2f}s "
              f"(median)")
        print(f"{am['steps']} steps, snapshot every {am['snapshot_every']}: with "
              f"{am['with_s']:.1f}s (each block's snapshot durable inside it), without "
              f"{am['without_s']:.1f}s (x{am['amortized_slowdown']:.3f})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(args.threads)
    if args.restore_child:
        pairs = [item.split("=", 1) for item in args.restore_child]
        child = restore_then_train if args.train_after else restore_once
        print(json.dumps([child(side, source, args) for side, source in pairs]))
        return 0
    cfg = model_config(args)
    load_start = loadavg()

    torch.manual_seed(0)
    np.random.seed(0)
    model = GPT(cfg)
    opt = make_optimizer(model)
    trainer = Trainer(model, opt, cfg, args.batch, args.seq)
    trainer.step()
    densify(opt)
    tensors = state_tensors(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    params = sum(p.numel() for p in model.parameters())

    parent = args.dir or "/var/tmp"
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    need = 7 * state_bytes + (256 << 20)
    if free < need:
        print(f"not enough free space in {parent}: {free / 1e9:.1f} GB free, "
              f"{need / 1e9:.1f} GB needed", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="cairn-state-bench-", dir=parent)
    log(f"state: {params / 1e6:.1f} M parameters, {state_bytes / 1e9:.3f} GB "
        f"({len(tensors)} tensors); threads {args.threads}; runs {args.runs}; dir {root}; "
        f"load {load_start}")

    if not args.no_dcp_process:
        # DCP's PROCESS executor needs a default process group (it broadcasts the address of
        # its worker's store); one rank, in-process store. Every dcp call passes no_dist=True.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        raw = measure(args, root, cfg, model, opt, trainer, tensors)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    del tensors
    out = report(args, raw, state_bytes, params)
    out["loadavg_start"], out["loadavg_end"] = load_start, loadavg()
    print(json.dumps(out))
    return 0


def report(args: argparse.Namespace, raw: dict[str, Any], state_bytes: int,
           params: int) -> dict[str, Any]:
    """Print the tables and return every figure (the last line's JSON)."""
    summary = summarize_snapshots(raw["snaps"])
    memcpy = summarize_memcpy(raw["memcpy"], state_bytes)
    async_names = [n for n in summary if n.startswith("dcp_async")]
    dcp_best = min(async_names, key=lambda n: summary[n]["stall_median_s"])
    cairn = summary["cairn"]
    restores, cold, steps, frozen = raw["restores"], raw["cold"], raw["steps"], raw["frozen"]
    restore_med = {k: statistics.median(v) for k, v in restores.items()}
    resident_med = {k: statistics.median(v) for k, v in raw["restores_resident"].items()}
    best_resident = min(TORCH_LOADS, key=lambda k: resident_med[k])
    populate = {t: statistics.median(v) for t, v in raw["populate"].items()}
    best_load = min(TORCH_LOADS, key=lambda k: restore_med[k])
    peers = {f"memcpy_{t}": f"numpy copyto of every tensor's bytes into a pre-faulted memfd "
                            f"StagingBuffer, split evenly among {t} thread(s)"
             for t in memcpy["by_threads"]}
    peers.update(raw["peers"])
    peers.update({f"restore_{k}": v for k, v in RESTORE_PEERS.items()})

    print()
    print(f"state {state_bytes / 1e9:.3f} GB ({params / 1e6:.1f} M parameters + Adam), "
          f"threads {args.threads}, {args.runs} runs; seconds")
    print_snapshot_table(summary, memcpy, dcp_best)
    print()
    print_restore_table(restores, raw["restores_resident"], cold, best_load)
    print()
    first = summarize_first_steps(raw["first_steps"]) if raw["first_steps"] else {}
    best_first = min(TORCH_LOADS, key=lambda k: first[k]["restore_and_first_step_median_s"]) \
        if first else None
    if first:
        print_first_step_table(first, raw["first_steps_cold"], best_first)
        print()
    print_steps(frozen, steps)
    print()
    print_breakdowns(f"snapshots (time to durable, mean of {args.runs} runs)",
                     {n: s["breakdown"] for n, s in summary.items()})
    print_breakdowns("cairn's first snapshot", {"cairn (first)": cairn["first_breakdown"]})
    print("  (its wait_for_warm_up: the part of the first staging buffer's page population "
          "not yet done; fresh memory, " + ", ".join(
              f"{t} thread(s) {state_bytes / s / 1e9:.2f} GB/s = {s:.3f}s"
              for t, s in populate.items()) + ", medians)")
    print_breakdowns(f"restores (mean of {args.runs} runs)", raw["restore_parts"])
    print()
    print_peers(peers)
    resident_ratio = resident_med["cairn"] / resident_med[best_resident]
    first_ratio = (first["cairn"]["restore_and_first_step_median_s"]
                   / first[best_first]["restore_and_first_step_median_s"]) if first else None
    figures = {
        "stall_vs_memcpy": round(cairn["stall_median_s"] / memcpy["median_s"], 4),
        "stall_vs_dcp_best": round(
            cairn["stall_median_s"] / summary[dcp_best]["stall_median_s"], 4),
        "restore_vs_torch_load": round(restore_med["cairn"] / restore_med[best_load], 4),
        "resident_vs_torch_load_mmap": round(
            resident_med["cairn"] / resident_med["torch_load_mmap"], 4),
        "frozen90_vs_floor": frozen["frozen90_vs_floor"],
        "amortized_slowdown": steps["amortized"]["amortized_slowdown"] if steps else None,
        "first_stall_vs_median": round(cairn["first_stall_s"] / cairn["stall_median_s"], 4),
    }
    targets = {k: {"value": v, "target": TARGETS[k], "met": v is not None and v <= TARGETS[k]}
               for k, v in figures.items()}
    print()
    print(f"{'target':<28} {'value':>8} {'<=':>6}  met")
    for k, t in targets.items():
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        print(f"{k:<28} {value:>8} {t['target']:>6.2f}  {'yes' if t['met'] else 'NO'}")
    if first:
        print(f"(not a target: restore + first real step against {best_first} "
              f"{first_ratio:.3f}; resident against the faster load when resident, "
              f"{best_resident}: {resident_ratio:.3f})")
    print()
    return {
        **figures,
        "restore_vs_dcp_load": round(restore_med["cairn"] / restore_med["dcp_load"], 4),
        "restore_vs_torch_load_plain": round(restore_med["cairn"] / restore_med["torch_load"], 4),
        "restore_vs_torch_load_mmap": round(
            restore_med["cairn"] / restore_med["torch_load_mmap"], 4),
        "restore_vs_torch_load_resident": round(resident_ratio, 4),
        "restore_first_step_vs_torch_load": None if first_ratio is None else round(first_ratio, 4),
        "torch_load_best_first_step": best_first,
        "first_step_runs": args.first_step_runs,
        "first_step_cold_cache": raw["first_steps_cold"],
        "restore_then_train": first,
        "torch_load_best": best_load,
        "torch_load_best_resident": best_resident,
        "dcp_best": dcp_best,
        "targets": targets,
        "peers": peers,
        "state_bytes": state_bytes,
        "params": params,
        "small": args.small,
        "quick": args.quick,
        "threads": args.threads,
        "runs": args.runs,
        "batch": args.batch,
        "seq": args.seq,
        "cold_cache": cold,
        "memcpy": memcpy,
        "populate_s": {str(t): round(v, 4) for t, v in populate.items()},
        "populate_gbps": {str(t): round(state_bytes / v / 1e9, 3) for t, v in populate.items()},
        "snapshots": summary,
        "restore": {k: {"median_s": round(restore_med[k], 4), "runs_s": [round(x, 4) for x in v],
                        "resident_median_s": round(resident_med[k], 4),
                        "resident_runs_s": [round(x, 4) for x in raw["restores_resident"][k]],
                        "breakdown": raw["restore_parts"][k]} for k, v in restores.items()},
        "frozen90": frozen,
        "steps": steps,
    }


if __name__ == "__main__":
    sys.exit(main())
