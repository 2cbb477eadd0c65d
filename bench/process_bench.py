"""Process snapshots: cairn's CRIU dump + ingest against plain ``criu dump`` / ``criu restore``.

One run, both sides on the same process state and the same disk. For each size (``--sizes``,
default 0.5, 1 and 2 GiB) the bench starts ``bench/process_workload.py``, a Python process
holding that many bytes of random data in private anonymous memory (nothing in it dedups),
in its own session, with stdin ``/dev/null`` and stdout/stderr appended to log files, no
terminal, no sockets. It is started at a high PID (``cairn.process.pids.spawn_at``, as
``cairn run`` does) with ``PR_SET_PDEATHSIG=SIGKILL`` so it never outlives the bench. With
``CAIRN_SECRET_FILE`` set, cairn's sides use encrypted stores (ADR 0025; the output says
which), so that two runs compare encryption off and on.

Each size then goes through rounds; in every round every side dumps the same state, in
rotating order (each side goes first in turn; the start moves from size to size):

* round 0: the **first** dump;
* rounds 1 .. ``--runs``-1: **consecutive** dumps, each after the workload replaced 10% of
  its memory with fresh random bytes in contiguous 64 KiB runs at random page-aligned
  positions (one run in every 640 KiB stratum);
* a last round after it replaced 10% of its pages, one 4 KiB page each, picked at random
  (the **scattered** case: ``scattered_bytes_fraction`` <= 0.25, which page deltas meet by
  storing a changed 32 KiB chunk as its changed pages, ADR 0022).

The sides of one round:

* **plain, disk**: ``criu dump --leave-running`` (the command line of
  ``cairn.process.criu.dump``: ``-o dump.log --manage-cgroups=ignore --ghost-limit 512M``)
  into a fresh directory under the bench directory, then ``sync``. Dump-to-durable = dump +
  sync. Bytes written = the image (CRIU writes all of it every time). Its directory is what
  the plain restore uses.
* **plain, tmpfs**: the same dump into a fresh directory in ``/dev/shm`` (removed at once; not
  durable), whenever the memory headroom covers 1.2 x the size (as cairn's policy requires).
* **cairn**: what ``cairn run`` does: the same dump into a fresh staging directory where its
  staging policy puts it (``cairn.process.staging``, ``--staging auto``: the bench
  directory's disk while its page cache takes 1.2 x the last image — the resident memory
  before the first — without writeback throttling, else tmpfs when the memory headroom covers
  that, else disk), then ``cairn.process.snapshot.ingest`` into a local store on disk
  (durable when it returns; chunks of the pages images start at every pagemap entry and every
  32 KiB of virtual address, and dedup against the key's previous snapshot), then the staging
  is deleted (not timed). Dump-to-durable = dump + ingest. Bytes written =
  ``IngestReport.bytes_written``. The ingest's time is split into the store's chunk digests
  (``hash``) and the rest (read, dedup, pack writes, fsyncs, commit).

Before each side the bench runs ``sync`` and drops the page cache, so that no side starts
with another's dirty pages or a fuller cache. Frozen time is CRIU's own ``frozen_time`` from
the dump's ``stats-dump`` (``cairn.process.images.read_dump_stats``) for every side. Per size:
``frozen_ratio`` = median cairn frozen / median plain frozen on plain's faster medium (named
in the output and in ``plain_best``), over all rounds; ``floor_ms`` = the image bytes over the
host's memory bandwidth (``memmove`` between two 256 MiB buffers, best of 3, on one thread and
on ``nproc`` threads, the faster; measured once at the start): a dump to tmpfs copies every
page once, so no dump of that image can be frozen for less; ``frozen_vs_floor`` = cairn's
frozen / the floor (no target); ``consecutive_bytes_fraction`` = cairn's bytes written /
image bytes of the same dump, median over the consecutive contiguous rounds.

**Restore** (after the last round): the workload's checksum of its buffer is taken before the
last round's dumps, then it is killed; ``--restore-runs`` times (default 3; the order rotates),
page cache dropped before each side: *plain* = ``criu restore`` from plain CRIU's last dump
directory on disk (``cairn.process.criu.restore``: ``--restore-detached --restore-sibling``);
*eager*, *eager-copy* and *lazy* = ``cairn.process.restore.restore`` of cairn's last snapshot
from the store (verified), as ``cairn run --restore eager|lazy`` does it, the scratch copy where
the staging policy puts a copy plus the process: *eager* streams the pages images to
``criu restore --stream`` from verified chunks (the default, ADR 0034), *eager-copy* fetches
every image into the scratch before CRIU starts (the path GPU snapshots take); lazy restores
twice, as ``lazy`` and ``lazy-runs``.
After each restore the workload takes its *next step* (the same pages on every side): it reads
64 bytes of every page of 10% of its memory in 2 MiB runs (``touch-runs``, a step's working
set: ``lazy-runs``) or of a random 10% of its pages (``touch``, the adversarial case:
``lazy``); plain and eager take both steps, one after the other, each step's own time added
to the restore's. For lazy, the bench then waits until every page is in (``resident_s``); the
whole buffer must then match the checksum (``restore_verified``) and the touched bytes must
agree across sides. Per size: ``eager_vs_plain`` = median eager restore / median plain
restore (target <= 1.5 at every size); ``lazy_next_step_vs_plain`` = median time to
``lazy-runs``'s next step / median plain restore (target <= 0.5 for the largest size, ADR
0026 says why the runs case); ``lazy_random_next_step_vs_plain`` the same for the random
pages (no target); ``eager_copy_vs_plain`` the same for the copy (no target); the breakdown
gives each eager side's fetch and CRIU seconds (streamed: the fetch is the small images only,
the pages arrive during CRIU), the copy's fetch rate (image MB / fetch s), the streamed
restore's (image MB / whole restore s) and the disk's (the plain images read cold, 4 MiB
reads).

**torch** (no target): ``tests/support/criu_training.py`` (a DataLoader with 2 worker
processes) is dumped by every side, twice, ``--torch-gap`` seconds apart; the table gives its
image bytes and what cairn wrote for the first and the consecutive dump.

Top-level figures (last line, JSON): ``frozen_ratio``, ``frozen_vs_floor``,
``consecutive_bytes_fraction``, ``scattered_bytes_fraction`` and ``manifest_mib_per_gib`` (the
manifest as the slot log stores it, largest round) are the worst (largest) over the sizes,
each also by size; targets: ``frozen_ratio`` <= 1.2, ``consecutive_bytes_fraction`` <= 0.2,
``scattered_bytes_fraction`` <= 0.25, ``manifest_mib_per_gib`` <= 2,
``eager_restore_vs_plain`` <= 1.5 (worst size), ``lazy_next_step_vs_plain`` <= 0.5 (largest
size). Needs root and CRIU
(``make criu``); about 5x the largest size of free disk under ``--dir`` (default a temp dir
under /var/tmp, removed at the end) and, for the tmpfs sides, 1.2x the largest size free in
``/dev/shm`` (its directory there is removed at the end too). MB is 10**6 bytes. Every
process the bench starts is killed (with its process group) and reaped before it exits, on
failure too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from benchenv import drop_caches, loadavg  # bench/ is on sys.path when run as a script
from cairn.process import compat as compat_mod
from cairn.process import criu as criu_mod
from cairn.process import pids as pids_mod
from cairn.process import restore as restore_mod
from cairn.process import snapshot as snap_mod
from cairn.process import staging as staging_mod
from cairn.process import workload as workload_mod
from cairn.process.images import PAGE_CHUNK, read_dump_stats
from cairn.runtime.stores import configured_secret, open_store  # CAIRN_SECRET_FILE: encrypted
from cairn.store import Key, Store
from cairn.store import manifest as manifest_mod
from cairn.store import store as store_mod

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKLOAD = os.path.join(HERE, "process_workload.py")
TRAINING = os.path.join(REPO, "tests", "support", "criu_training.py")

FRACTION = 0.10
RUN_BYTES = 64 << 10
TARGETS = {"frozen_ratio": 1.2, "consecutive_bytes_fraction": 0.2,
           "scattered_bytes_fraction": 0.25, "manifest_mib_per_gib": 2.0,
           "eager_restore_vs_plain": 1.5, "lazy_next_step_vs_plain": 0.5}
PLAIN_MEDIA = ("disk", "tmpfs")  # plain CRIU dumps to both; its faster one is the baseline
BANDWIDTH_BYTES = 256 << 20  # per buffer of the memory-bandwidth probe
BANDWIDTH_RUNS = 3
PR_SET_PDEATHSIG = 1
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``0.5G``, ``512M``, ``64MiB``, ``1048576`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r}; use e.g. 512M or 1G")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size < (1 << 20):
        raise argparse.ArgumentTypeError("size must be at least 1M")
    return size


def human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % (scale // 4) == 0:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def image_bytes(directory: str) -> int:
    """Bytes of the files CRIU wrote, its log left out (as ingest counts them)."""
    total = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name != criu_mod.DUMP_LOG and os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(text)
    os.rename(tmp, path)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def _pdeathsig() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def tail(path: str, lines: int = 10) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return ""


# -- the floor: how fast this host copies memory ------------------------------------------------


def memory_bandwidth(nbytes: int = BANDWIDTH_BYTES, runs: int = BANDWIDTH_RUNS) -> dict[str, Any]:
    """Bytes copied per second by ``memmove`` between two ``nbytes`` buffers, best of ``runs``,
    on one thread and split over ``os.cpu_count()`` threads (ctypes calls release the GIL);
    ``gbps`` is the faster of the two. A dump to tmpfs copies each page once, so the image
    bytes over this rate is the least time any dump of them can take (the floor)."""
    src, dst = bytearray(os.urandom(1 << 20) * (nbytes >> 20)), bytearray(nbytes)
    src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    ctypes.memmove(dst_addr, src_addr, nbytes)  # fault every page in before timing
    threads = max(1, os.cpu_count() or 1)

    def copy(parts: int) -> float:
        step = -(-nbytes // parts) // 4096 * 4096 or nbytes
        spans = [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]
        workers = [threading.Thread(target=ctypes.memmove,
                                    args=(dst_addr + o, src_addr + o, n)) for o, n in spans[1:]]
        start = time.perf_counter()
        for w in workers:
            w.start()
        ctypes.memmove(dst_addr + spans[0][0], src_addr + spans[0][0], spans[0][1])
        for w in workers:
            w.join()
        return nbytes / (time.perf_counter() - start)

    single = max(copy(1) for _ in range(runs))
    parallel = max(copy(threads) for _ in range(runs))
    del src, dst
    best = "1 thread" if single >= parallel else f"{threads} threads"
    return {"gbps": round(max(single, parallel) / 1e9, 3), "config": best,
            "single_thread_gbps": round(single / 1e9, 3),
            "all_threads_gbps": round(parallel / 1e9, 3), "threads": threads,
            "buffer_bytes": nbytes, "runs": runs}


@contextlib.contextmanager
def hash_timer() -> Any:
    """Seconds the store spends in its chunk digest while the block runs (``["s"]``)."""
    spent = {"s": 0.0}
    original = store_mod.Store.chunk_digest

    def timed(self: Store, data: Any) -> str:
        start = time.perf_counter()
        try:
            return original(self, data)
        finally:
            spent["s"] += time.perf_counter() - start

    store_mod.Store.chunk_digest = timed  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        store_mod.Store.chunk_digest = original  # type: ignore[method-assign]


# -- processes the bench starts -----------------------------------------------------------------


class Proc:
    """A process tree the bench started or restored; :meth:`kill` kills and reaps it."""

    live: set[Proc] = set()

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.popen = popen
        Proc.live.add(self)

    def kill(self) -> None:
        pid = self.pid
        for p in reversed(workload_mod.process_tree(pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid and pid != os.getpgrp():
                os.killpg(pid, signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=30)
        else:
            try:
                os.waitpid(pid, 0)  # restored with --restore-sibling: our child
            except ChildProcessError:
                deadline = time.monotonic() + 30
                while alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
        Proc.live.discard(self)

    @classmethod
    def kill_all(cls) -> None:
        """Every tree still registered, then whatever else descends from the bench (a CRIU
        interrupted mid-restore leaves its half-restored tree as the bench's children)."""
        for proc in list(cls.live):
            with contextlib.suppress(Exception):
                proc.kill()
        for pid in reversed(workload_mod.process_tree(os.getpid())[1:]):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass


class Workload:
    """``process_workload.py`` holding ``size`` bytes, driven through its ctl/ack files."""

    def __init__(self, root: str, size: int, seed: int) -> None:
        self.dir = os.path.join(root, "workload")
        os.makedirs(self.dir)
        self.size = size
        self.seed = seed
        self.ctl = os.path.join(self.dir, "ctl")
        self.ack = os.path.join(self.dir, "ack")
        self.stdout = os.path.join(self.dir, "stdout.log")
        self.stderr = os.path.join(self.dir, "stderr.log")
        self.argv = [sys.executable, WORKLOAD, "--bytes", str(size), "--dir", self.dir,
                     "--seed", str(seed)]
        self.seq = 0
        self.proc: Proc | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}

        def spawn() -> subprocess.Popen[bytes]:
            with open(self.stdout, "ab") as out, open(self.stderr, "ab") as err:
                return subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True, cwd=self.dir,
                                        env=env, preexec_fn=_pdeathsig)

        try:
            popen = pids_mod.spawn_at(pids_mod.high_pid_base(), spawn)
        except OSError:
            popen = spawn()
        self.proc = Proc(popen.pid, popen)
        # Filling runs at several hundred MB/s; allow a slow, shared machine plenty.
        self._wait_ack(0, timeout=60 + self.size / 20e6)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _wait_ack(self, seq: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(self.ack, encoding="ascii") as f:
                    words = f.read().split(maxsplit=1)
                if words and int(words[0]) == seq:
                    return words[1].strip() if len(words) > 1 else ""
            except (FileNotFoundError, ValueError):
                pass
            if self.proc is None or not alive(self.proc.pid):
                raise RuntimeError(f"the workload (pid {self.proc and self.proc.pid}) is gone "
                                   f"before answering command {seq}:\n{tail(self.stderr)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workload did not answer command {seq} within "
                                   f"{timeout:.0f}s:\n{tail(self.stderr)}")
            time.sleep(0.005)

    def command(self, text: str) -> str:
        self.seq += 1
        write_atomic(self.ctl, f"{self.seq} {text}\n")
        result = self._wait_ack(self.seq, timeout=60 + self.size / 20e6)
        if result.startswith("error"):
            raise RuntimeError(f"workload command {text!r}: {result}")
        return result

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc = None

    def adopt(self, pid: int) -> None:
        """The process CRIU restored (a child of the bench)."""
        self.proc = Proc(pid)


# -- the two sides ------------------------------------------------------------------------------


class Sides:
    """Dump / restore, plain CRIU and cairn, for one process tree."""

    def __init__(self, criu: str, root: str, store: Store, key: str, shm: str) -> None:
        self.criu = criu
        self.root = root
        self.shm = shm  # the bench's directory on tmpfs
        self.store = store
        self.attempt = store.open_attempt(Key.parse(key))
        self.plain_dir: str | None = None  # the last plain dump on disk (what restores use)
        self.manifest: Any = None
        self.count = 0
        self.last_image: int | None = None  # what cairn's staging policy sizes the next dump by

    def plain_dump(self, pid: int, medium: str) -> dict[str, Any]:
        """``criu dump`` into a fresh directory on ``medium`` (disk: then ``sync``, so that
        dump-to-durable is comparable; tmpfs: the images are removed at once)."""
        self.count += 1
        on_disk = medium == "disk"
        if on_disk and self.plain_dir is not None:
            shutil.rmtree(self.plain_dir, ignore_errors=True)
        directory = os.path.join(self.root if on_disk else self.shm, f"plain-{self.count}")
        os.makedirs(directory)
        try:
            start = time.perf_counter()
            criu_mod.dump(self.criu, pid, directory, leave_running=True, timeout=600)
            dumped = time.perf_counter()
            if on_disk:
                os.sync()
            durable = time.perf_counter()
            stats = read_dump_stats(directory)
            size = image_bytes(directory)
        finally:
            if on_disk:
                self.plain_dir = directory
            else:
                shutil.rmtree(directory, ignore_errors=True)
        return {"medium": medium, "frozen_us": stats.frozen_us, "freezing_us": stats.freezing_us,
                "memdump_us": stats.memdump_us, "memwrite_us": stats.memwrite_us,
                "dump_s": round(dumped - start, 4), "sync_s": round(durable - dumped, 4),
                "durable_s": round(durable - start, 4) if on_disk else None,
                "image_bytes": size, "bytes_written": size}

    def cairn_dump(self, pid: int, tracked: list[str], compat: dict[str, Any],
                   tree: list[int]) -> dict[str, Any]:
        """What ``cairn run`` does: stage where its policy (``--staging auto``) puts this
        dump (sized by the last image, the resident memory before the first), dump, ingest."""
        self.count += 1
        estimate = workload_mod.resident_bytes(tree) if self.last_image is None else None
        choice = staging_mod.choose_staging(
            staging_mod.StagingMedium.AUTO, image_bytes=self.last_image, estimate_bytes=estimate,
            memory_dir=os.path.join(self.shm, "staging"),
            disk_dir=os.path.join(self.root, "staging"))
        staging = os.path.join(choice.parent, f"dump-{self.count}")
        os.makedirs(staging)
        try:
            start = time.perf_counter()
            criu_mod.dump(self.criu, pid, staging, leave_running=True, timeout=600)
            dumped = time.perf_counter()
            with hash_timer() as hashing:
                # The workload's files are under the bench's directory, not the staging's.
                report = snap_mod.ingest(self.attempt, staging, tracked_paths=tracked,
                                         roots=snap_mod.track_roots(log_dir=self.root),
                                         compat=compat, info={"root_pid": pid, "pids": tree,
                                                              "leave_running": True})
            durable = time.perf_counter()
            stats = read_dump_stats(staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.manifest = report.manifest
        self.last_image = report.image_bytes
        ingest_s = durable - dumped
        return {"medium": choice.medium.value, "staging_reason": choice.reason,
                "frozen_us": report.frozen_us, "freezing_us": stats.freezing_us,
                "memdump_us": stats.memdump_us, "memwrite_us": stats.memwrite_us,
                "dump_s": round(dumped - start, 4), "ingest_s": round(ingest_s, 4),
                "ingest_hash_s": round(hashing["s"], 4),
                "ingest_rest_s": round(ingest_s - hashing["s"], 4),
                "durable_s": round(durable - start, 4), "image_bytes": report.image_bytes,
                "bytes_written": report.bytes_written, "seq": report.manifest.seq,
                "manifest_bytes": len(manifest_mod.dumps(report.manifest.to_json()))}

    def _pidfile(self) -> str:
        pidfile = os.path.join(self.root, "restored.pid")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)
        return pidfile

    def raw_read_s(self) -> float:
        """Seconds to read the plain dump's files from the disk (cache dropped first), 4 MiB
        reads on one thread: the disk's own rate for these bytes."""
        assert self.plain_dir is not None
        drop_caches()
        buffer = memoryview(bytearray(4 << 20))
        start = time.perf_counter()
        for name in sorted(os.listdir(self.plain_dir)):
            fd = os.open(os.path.join(self.plain_dir, name), os.O_RDONLY)
            try:
                while os.readv(fd, [buffer]):
                    pass
            finally:
                os.close(fd)
        return time.perf_counter() - start

    def plain_restore(self) -> tuple[int, dict[str, Any], restore_mod.Restored | None]:
        assert self.plain_dir is not None
        pidfile = self._pidfile()
        start = time.perf_counter()
        pid = criu_mod.restore(self.criu, self.plain_dir, pidfile=pidfile, timeout=600)
        return pid, {"running_s": time.perf_counter() - start}, None

    def cairn_restore(self, mode: restore_mod.RestoreMode, *, stream: bool = True
                      ) -> tuple[int, dict[str, Any], restore_mod.Restored]:
        """What ``cairn run --restore MODE`` does: the scratch copy where the staging policy
        puts a copy plus the restored process (memory when the headroom covers both); eager
        streams the pages to CRIU unless ``stream`` is False (the scratch-copy path)."""
        choice = restore_mod.scratch_choice(
            staging_mod.StagingMedium.AUTO, self.manifest,
            memory_dir=os.path.join(self.shm, "restore"),
            disk_dir=os.path.join(self.root, "restore"))
        os.makedirs(choice.parent, exist_ok=True)
        scratch = os.path.join(choice.parent, f"restore-{self.manifest.seq}")
        pidfile = self._pidfile()

        def kill_tree(root: int) -> None:
            for p in reversed(workload_mod.process_tree(root)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)

        start = time.perf_counter()
        restored = restore_mod.restore(
            self.store, self.manifest, criu=self.criu, scratch=scratch, pidfile=pidfile,
            roots=snap_mod.track_roots(log_dir=self.root), mode=mode,
            prepare=lambda image_dir: (lambda: None), kill_tree=kill_tree, timeout=600,
            stream=stream)
        running = time.perf_counter() - start
        return restored.pid, {"running_s": running, "fetch_s": restored.fetch_s,
                              "criu_s": restored.criu_s, "scratch": choice.medium.value,
                              "mode": restored.mode.value, "streamed": restored.streamed}, restored


RESTORE_SIDES = ("plain", "eager", "eager-copy", "lazy", "lazy-runs")
TOUCH_RUN_BYTES = 2 << 20  # the working set of a step: 10% of the memory in 2 MiB runs


def restore_round(sides: Sides, wl: Workload, order: list[str], run: int, expected: str,
                  log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Each side restores the last snapshot in turn (cache dropped first); the workload then
    takes its next step, and its whole memory is checked against the checksum taken before
    the dump. The next step reads 10% of the pages at random (``next_step_s``) or 10% of the
    memory in 2 MiB runs (``next_step_runs_s``): a lazy restore serves one of them (``lazy``
    the random pages, ``lazy-runs`` the runs), plain and eager take both, one after the other
    (their memory is all in: each step's own time is added to the restore's). The same pages
    read on every side must hold the same bytes."""
    out: dict[str, dict[str, Any]] = {}
    touched: dict[str, set[str]] = {"random": set(), "runs": set()}
    random_cmd = f"touch {FRACTION} {run}"
    runs_cmd = f"touch-runs {FRACTION} {TOUCH_RUN_BYTES} {run}"
    for side in order:
        drop_caches()
        start = time.perf_counter()
        if side == "plain":
            pid, row, restored = sides.plain_restore()
        else:
            mode = restore_mod.RestoreMode.LAZY if side.startswith("lazy") else \
                restore_mod.RestoreMode.EAGER
            pid, row, restored = sides.cairn_restore(mode, stream=side != "eager-copy")
        try:
            wl.adopt(pid)
            if side == "lazy-runs":
                touched["runs"].add(wl.command(runs_cmd))
                row["next_step_runs_s"] = time.perf_counter() - start
            else:
                touched["random"].add(wl.command(random_cmd))
                row["next_step_s"] = time.perf_counter() - start
                if side != "lazy":
                    step = time.perf_counter()
                    touched["runs"].add(wl.command(runs_cmd))
                    row["next_step_runs_s"] = row["running_s"] + time.perf_counter() - step
            if restored is not None and restored.lazy is not None:
                restored.lazy.wait(600)
                row["resident_s"] = time.perf_counter() - start
                st = restored.lazy.stats
                row["bytes_served"] = st.bytes_served
                row["bytes_fetched"] = st.bytes_fetched
                row["faults"] = st.requests
                if st.handler is not None:
                    row["fault_bytes"] = st.handler.fault_bytes
                    row["zero_pages"] = st.handler.zero_pages
                    row["fault_fetch_s"] = round(st.handler.fault_fetch_s, 4)
                    row["fault_copy_s"] = round(st.handler.fault_copy_s, 4)
                row["failure"] = None if restored.lazy.failure is None else \
                    str(restored.lazy.failure)
            else:
                row["resident_s"] = row["running_s"]
            row["verified"] = alive(pid) and wl.command("checksum") == expected
        finally:
            if restored is not None:
                restored.close()
            wl.kill()
        out[side] = row
        step_s = row.get("next_step_s", row.get("next_step_runs_s", 0.0))
        log(f"  restore {side:<9} running {row['running_s']:6.2f}s next step "
            f"{step_s:6.2f}s all resident {row['resident_s']:6.2f}s "
            f"{'verified' if row['verified'] else 'CHECKSUM MISMATCH'}"
            + (f" ({row['faults']} faults, {row.get('fault_bytes', 0) / 1e6:.0f} MB on faults, "
               f"faults waited {row.get('fault_fetch_s', 0):.2f}s for pages, "
               f"{row.get('fault_copy_s', 0):.2f}s copying)" if "faults" in row else ""))
    if any(len(digests) > 1 for digests in touched.values()):
        for row in out.values():
            row["verified"] = False
    return out


def alternate(first_plain: bool) -> list[str]:
    return ["plain", "cairn"] if first_plain else ["cairn", "plain"]


def dump_order(sides: list[str], turn: int) -> list[str]:
    """``sides`` rotated by ``turn``: over consecutive rounds each side goes first in turn."""
    k = turn % len(sides)
    return sides[k:] + sides[:k]


def plain_media(shm: str, size: int) -> list[str]:
    """Where plain CRIU dumps: disk always; tmpfs where cairn's policy would stage there too
    (the headroom covers 1.2 x the image), else the dump would fail for space."""
    room = staging_mod.memory_headroom_bytes(shm)
    return list(PLAIN_MEDIA) if room >= staging_mod.MEMORY_FACTOR * size else ["disk"]


def dump_round(sides: Sides, order: list[str], pid: int, tracked: list[str],
               compat: dict[str, Any]) -> dict[str, Any]:
    """One dump by each of ``order`` ("plain-disk", "plain-tmpfs", "cairn"), the page cache
    dropped before each; plain's figures under ``plain_by_medium``."""
    row: dict[str, Any] = {"order": order, "plain_by_medium": {}}
    for side in order:
        drop_caches()
        tree = workload_mod.process_tree(pid)
        if side == "cairn":
            row["cairn"] = sides.cairn_dump(pid, tracked, compat, tree)
        else:
            medium = side.split("-", 1)[1]
            row["plain_by_medium"][medium] = sides.plain_dump(pid, medium)
        row["processes"] = len(tree)
    return row


# -- one size -------------------------------------------------------------------------------------


def bench_size(args: argparse.Namespace, criu: str, root: str, shm_root: str, size: int,
               index: int, bandwidth: dict[str, Any],
               log: Callable[[str], None]) -> dict[str, Any]:
    here = os.path.join(root, f"size-{size}")
    os.makedirs(here)
    shm = os.path.join(shm_root, f"size-{size}")
    os.makedirs(shm)
    wl = Workload(here, size, seed=index)
    store = open_store(os.path.join(here, "store"))
    rounds: list[dict[str, Any]] = []
    restores: list[dict[str, dict[str, Any]]] = []
    raw_read_s = 0.0
    try:
        started = time.perf_counter()
        wl.start()
        log(f"{human(size)}: workload pid {wl.pid} ready in {time.perf_counter() - started:.1f}s")
        compat = compat_mod.current_record(wl.argv, cwd=wl.dir, criu=criu)
        tracked = [wl.stdout, wl.stderr]
        sides = Sides(criu, here, store, f"bench/process/{size}", shm)
        media = plain_media(shm, size)
        names = [f"plain-{m}" for m in media] + ["cairn"]
        kinds = ["first"] + ["contiguous"] * (args.runs - 1) + ["scattered"]
        expected = ""
        for r, kind in enumerate(kinds):
            changed = 0
            if kind == "contiguous":
                changed = int(wl.command(f"contig {FRACTION} {RUN_BYTES}"))
            elif kind == "scattered":
                changed = int(wl.command(f"scatter {FRACTION}"))
            if r == len(kinds) - 1:
                expected = wl.command("checksum")  # the state both sides dump last
            order = dump_order(names, r + index)
            row = {"kind": kind, "changed_bytes": changed,
                   **dump_round(sides, order, wl.pid, tracked, compat)}
            row["plain"] = row["plain_by_medium"]["disk"]  # what the restore and sizes use
            by, c = row["plain_by_medium"], row["cairn"]
            plain_text = " ".join(f"{m} {by[m]['frozen_us'] / 1e3:7.1f}" for m in media)
            log(f"  round {r} {kind:<10} frozen ms plain {plain_text} cairn "
                f"({c['medium']}) {c['frozen_us'] / 1e3:7.1f}; durable s plain disk "
                f"{row['plain']['durable_s']:6.2f} cairn {c['durable_s']:6.2f}; image "
                f"{c['image_bytes'] / 1e6:7.1f} MB, cairn wrote {c['bytes_written'] / 1e6:7.1f} "
                f"MB ({order[0]} first)")
            rounds.append(row)

        # restore: kill, then each side restores the last snapshot in turn, is checked, killed
        wl.kill()
        raw_read_s = sides.raw_read_s()
        for i in range(args.restore_runs):
            restores.append(restore_round(sides, wl, dump_order(list(RESTORE_SIDES), i + index), i,
                                          expected, log))
    finally:
        wl.kill()
        store.close()
        shutil.rmtree(here, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return summarize_size(size, rounds, summarize_restores(restores, raw_read_s), bandwidth)


def med(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize_dumps(rounds: list[dict[str, Any]], bandwidth: dict[str, Any]) -> dict[str, Any]:
    """Frozen time: cairn against plain CRIU's faster medium, and both against the floor (the
    image over the host's memory bandwidth); the dump side's breakdown."""
    media = [m for m in PLAIN_MEDIA if m in rounds[0]["plain_by_medium"]]
    plain = {m: statistics.median(r["plain_by_medium"][m]["frozen_us"] / 1e3 for r in rounds)
             for m in media}
    best = min(media, key=lambda m: plain[m])
    cairn = statistics.median(r["cairn"]["frozen_us"] / 1e3 for r in rounds)
    image = statistics.median(r["cairn"]["image_bytes"] for r in rounds)
    floor_ms = image / (bandwidth["gbps"] * 1e9) * 1e3
    cairn_media = sorted({r["cairn"]["medium"] for r in rounds})

    def cairn_med(field: str, scale: float = 1.0) -> float | None:
        return med([r["cairn"][field] / scale for r in rounds])

    return {
        "frozen_ratio": round(cairn / plain[best], 4),
        "plain_best": best,
        "plain_media": media,
        "cairn_staging": cairn_media[0] if len(cairn_media) == 1 else "+".join(cairn_media),
        "cairn_staging_reason": rounds[-1]["cairn"]["staging_reason"],
        "floor_ms": round(floor_ms, 2),
        "frozen_vs_floor": round(cairn / floor_ms, 4),
        "plain_vs_floor": round(plain[best] / floor_ms, 4),
        "frozen_ms": {"plain": round(plain[best], 2), "cairn": round(cairn, 2),
                      "plain_by_medium": {m: round(v, 2) for m, v in plain.items()},
                      "plain_runs": {m: [round(r["plain_by_medium"][m]["frozen_us"] / 1e3, 2)
                                         for r in rounds] for m in media},
                      "cairn_runs": [round(r["cairn"]["frozen_us"] / 1e3, 2) for r in rounds]},
        "breakdown": {"cairn_freezing_ms": cairn_med("freezing_us", 1e3),
                      "cairn_memdump_ms": cairn_med("memdump_us", 1e3),
                      "cairn_memwrite_ms": cairn_med("memwrite_us", 1e3),
                      "cairn_dump_s": cairn_med("dump_s"),
                      "cairn_ingest_s": cairn_med("ingest_s"),
                      "cairn_ingest_hash_s": cairn_med("ingest_hash_s"),
                      "cairn_ingest_rest_s": cairn_med("ingest_rest_s")},
    }


def summarize_restores(runs: list[dict[str, dict[str, Any]]], raw_read_s: float
                       ) -> dict[str, Any]:
    """Medians per side; eager against plain CRIU's restore; lazy's next step against it."""
    def side(name: str, field: str) -> float | None:
        return med([r[name][field] for r in runs if r[name].get(field) is not None])

    plain = side("plain", "running_s")
    eager = side("eager", "running_s")
    copy = side("eager-copy", "running_s")
    # The target is judged on the step that reads its working set in runs (ADR 0026).
    lazy_step, lazy_random = side("lazy-runs", "next_step_runs_s"), side("lazy", "next_step_s")
    fetch = side("eager", "fetch_s")
    return {
        "plain_s": plain, "eager_s": eager, "eager_copy_s": copy,
        "eager_vs_plain": round(eager / plain, 4) if eager and plain else None,
        "eager_copy_vs_plain": round(copy / plain, 4) if copy and plain else None,
        "eager_streamed": all(r["eager"].get("streamed") for r in runs),
        "lazy_running_s": side("lazy", "running_s"),
        "next_step_s": {name: side(name, "next_step_s") for name in RESTORE_SIDES
                        if name != "lazy-runs"},
        "next_step_runs_s": {name: side(name, "next_step_runs_s") for name in RESTORE_SIDES
                             if name != "lazy"},
        "lazy_next_step_vs_plain": round(lazy_step / plain, 4) if lazy_step and plain else None,
        "lazy_random_next_step_vs_plain": round(lazy_random / plain, 4)
        if lazy_random and plain else None,
        "resident_s": {name: side(name, "resident_s") for name in RESTORE_SIDES},
        "breakdown": {"eager_fetch_s": fetch, "eager_criu_s": side("eager", "criu_s"),
                      "eager_copy_fetch_s": side("eager-copy", "fetch_s"),
                      "eager_copy_criu_s": side("eager-copy", "criu_s"),
                      "lazy_fetch_s": side("lazy", "fetch_s"),
                      "lazy_criu_s": side("lazy", "criu_s"),
                      "raw_read_s": round(raw_read_s, 4)},
        "scratch": runs[0]["eager"]["scratch"],
        "lazy_mode": runs[0]["lazy"]["mode"],
        "runs": runs,
        "verified": all(r[name]["verified"] for r in runs for name in RESTORE_SIDES),
        "checked": len(runs) * len(RESTORE_SIDES),
    }


def summarize_size(size: int, rounds: list[dict[str, Any]], restores: dict[str, Any],
                   bandwidth: dict[str, Any]) -> dict[str, Any]:
    first = rounds[0]
    contig = [r for r in rounds if r["kind"] == "contiguous"]
    scattered = [r for r in rounds if r["kind"] == "scattered"]
    consecutive = contig  # durable and dump figures: the contiguous case
    fractions = [r["cairn"]["bytes_written"] / r["cairn"]["image_bytes"] for r in contig]
    scatter_fractions = [r["cairn"]["bytes_written"] / r["cairn"]["image_bytes"]
                         for r in scattered]
    dumps = summarize_dumps(rounds, bandwidth)

    def durable(side: str, rows: list[dict[str, Any]]) -> float | None:
        return med([r[side]["durable_s"] for r in rows])

    return {
        "size_bytes": size,
        "label": human(size),
        **dumps,
        "consecutive_bytes_fraction": round(statistics.median(fractions), 4),
        "consecutive_bytes_fractions": [round(f, 4) for f in fractions],
        "scattered_bytes_fraction": round(scatter_fractions[0], 4) if scatter_fractions else None,
        "durable_s": {"plain_first": first["plain"]["durable_s"],
                      "cairn_first": first["cairn"]["durable_s"],
                      "plain_consecutive": durable("plain", consecutive),
                      "cairn_consecutive": durable("cairn", consecutive),
                      "cairn_dump_consecutive": med([r["cairn"]["dump_s"] for r in consecutive]),
                      "cairn_ingest_consecutive": med([r["cairn"]["ingest_s"]
                                                       for r in consecutive]),
                      "plain_dump_consecutive": med([r["plain"]["dump_s"] for r in consecutive]),
                      "plain_sync_consecutive": med([r["plain"]["sync_s"] for r in consecutive])},
        "restore": {**restores,
                    "image_bytes": rounds[-1]["cairn"]["image_bytes"],
                    # The scratch-copy path's fetch (image into the scratch, before CRIU), and
                    # the streamed path's whole restore (pages through CRIU, overlapped).
                    "fetch_mbps": (round(rounds[-1]["cairn"]["image_bytes"] / 1e6
                                         / restores["breakdown"]["eager_copy_fetch_s"], 1)
                                   if restores["breakdown"]["eager_copy_fetch_s"] else None),
                    "streamed_mbps": (round(rounds[-1]["cairn"]["image_bytes"] / 1e6
                                            / restores["eager_s"], 1)
                                      if restores["eager_s"] else None),
                    "raw_disk_mbps": (round(rounds[-1]["plain"]["image_bytes"] / 1e6
                                            / restores["breakdown"]["raw_read_s"], 1)
                                      if restores["breakdown"]["raw_read_s"] else None)},
        "restore_verified": restores["verified"],
        "restores_checked": restores["checked"],
        "bytes": {"image_first": first["cairn"]["image_bytes"],
                  "plain_first": first["plain"]["bytes_written"],
                  "cairn_first": first["cairn"]["bytes_written"],
                  "image_consecutive": contig[0]["cairn"]["image_bytes"],
                  "plain_consecutive": contig[0]["plain"]["bytes_written"],
                  "cairn_consecutive": contig[0]["cairn"]["bytes_written"],
                  "changed_consecutive": contig[0]["changed_bytes"],
                  "image_scattered": scattered[0]["cairn"]["image_bytes"] if scattered else None,
                  "cairn_scattered": scattered[0]["cairn"]["bytes_written"] if scattered else None,
                  "changed_scattered": scattered[0]["changed_bytes"] if scattered else None},
        # The manifest as the slot log stores it (compact JSON), per GiB of image, the
        # largest of the rounds (target <= 2 MiB per GiB).
        "manifest_mib_per_gib": round(max(
            r["cairn"]["manifest_bytes"] / r["cairn"]["image_bytes"] * 1024 for r in rounds), 3),
        "rounds": rounds,
    }


# -- a real torch training process ---------------------------------------------------------------


def bench_torch(args: argparse.Namespace, criu: str, root: str, shm_root: str,
                log: Callable[[str], None]) -> dict[str, Any]:
    here = os.path.join(root, "torch")
    os.makedirs(here)
    shm = os.path.join(shm_root, "torch")
    os.makedirs(shm)
    metrics = os.path.join(here, "metrics.txt")
    argv = [sys.executable, TRAINING, "--steps", str(10**9), "--metrics", metrics,
            "--out", os.path.join(here, "weights.bin"), "--sleep", "0.05"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    stdout, stderr = os.path.join(here, "stdout.log"), os.path.join(here, "stderr.log")
    store = open_store(os.path.join(here, "store"))
    proc: Proc | None = None
    rounds: list[dict[str, Any]] = []
    try:
        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                     start_new_session=True, cwd=here, env=env,
                                     preexec_fn=_pdeathsig)
        proc = Proc(popen.pid, popen)

        def steps() -> int:
            try:
                with open(metrics, "rb") as f:
                    return f.read().count(b"\n")
            except FileNotFoundError:
                return 0

        deadline = time.monotonic() + 300
        while steps() < 20:
            if popen.poll() is not None:
                raise RuntimeError(f"the training process exited {popen.returncode}:\n"
                                   f"{tail(stderr)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the training process did not reach 20 steps:\n{tail(stderr)}")
            time.sleep(0.1)
        tree = workload_mod.process_tree(proc.pid)
        tracked = workload_mod.append_files(workload_mod.open_files(tree))
        compat = compat_mod.current_record(argv, cwd=here, criu=criu)
        sides = Sides(criu, here, store, "bench/process/torch", shm)
        names = [f"plain-{m}" for m in plain_media(shm, workload_mod.resident_bytes(tree))]
        log(f"torch: training pid {proc.pid}, {len(tree)} processes, step {steps()}")
        for r in range(2):
            if r:
                time.sleep(args.torch_gap)
            row = {"kind": "first" if r == 0 else "consecutive", "step": steps(),
                   **dump_round(sides, dump_order([*names, "cairn"], r), proc.pid, tracked,
                                compat)}
            by, c = row["plain_by_medium"], row["cairn"]
            row["plain"] = min(by.values(), key=lambda d: d["frozen_us"])
            plain_text = " ".join(f"{m} {d['frozen_us'] / 1e3:.1f}" for m, d in by.items())
            log(f"  dump {r}: frozen ms plain {plain_text} cairn "
                f"({c['medium']}) {c['frozen_us'] / 1e3:.1f}; image "
                f"{c['image_bytes'] / 1e6:.1f} MB, cairn wrote {c['bytes_written'] / 1e6:.1f} MB")
            rounds.append(row)
        if popen.poll() is not None:
            raise RuntimeError(f"the training process died after the dumps:\n{tail(stderr)}")
    finally:
        if proc is not None:
            proc.kill()
        store.close()
        shutil.rmtree(here, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    first, second = rounds
    return {
        "processes": second["processes"],
        "gap_s": args.torch_gap,
        "image_first": first["cairn"]["image_bytes"],
        "cairn_first": first["cairn"]["bytes_written"],
        "image_consecutive": second["cairn"]["image_bytes"],
        "cairn_consecutive": second["cairn"]["bytes_written"],
        "consecutive_bytes_fraction": round(second["cairn"]["bytes_written"]
                                            / second["cairn"]["image_bytes"], 4),
        "frozen_ms": {"plain": [r["plain"]["frozen_us"] / 1e3 for r in rounds],
                      "cairn": [r["cairn"]["frozen_us"] / 1e3 for r in rounds]},
        "rounds": rounds,
    }


# -- output ---------------------------------------------------------------------------------------


def print_head(*lines: str) -> None:
    """A table's header lines and a rule as wide as the first."""
    for line in lines:
        print(line)
    print("-" * len(lines[0]))


def print_frozen(sizes: list[dict[str, Any]], bandwidth: dict[str, Any]) -> None:
    """Frozen time (CRIU's own), plain on each medium, cairn on its staging, the floor; then
    where the dump side's time goes."""
    print(f"frozen ms (medians over all rounds): plain CRIU per medium, cairn on the medium its "
          f"staging policy chose; ratio = cairn / plain's faster medium; floor = image / "
          f"{bandwidth['gbps']:.2f} GB/s memmove ({bandwidth['config']}; 1 thread "
          f"{bandwidth['single_thread_gbps']:.2f}, {bandwidth['threads']} threads "
          f"{bandwidth['all_threads_gbps']:.2f} GB/s)")
    print_head(f"{'size':<8} {'plain':>9} {'plain':>9} {'plain':>6} {'cairn':>9} {'cairn':>7} "
               f"{'ratio':>6} | {'floor':>7} {'cairn /':>7} {'plain /':>7}",
               f"{'':<8} {'disk':>9} {'tmpfs':>9} {'best':>6} {'':>9} {'staging':>7} {'':>6} | "
               f"{'ms':>7} {'floor':>7} {'floor':>7}")
    for s in sizes:
        f = s["frozen_ms"]
        by = f["plain_by_medium"]
        tmpfs = f"{by['tmpfs']:>9.1f}" if "tmpfs" in by else f"{'-':>9}"
        print(f"{s['label']:<8} {by['disk']:>9.1f} {tmpfs} {s['plain_best']:>6} "
              f"{f['cairn']:>9.1f} {s['cairn_staging']:>7} {s['frozen_ratio']:>6.2f} | "
              f"{s['floor_ms']:>7.1f} {s['frozen_vs_floor']:>7.2f} {s['plain_vs_floor']:>7.2f}")
    for s in sizes:
        print(f"  {s['label']}: plain CRIU baseline = criu dump to {s['plain_best']} (the faster "
              f"of {', '.join(s['plain_media'])}); cairn staging: {s['cairn_staging_reason']}")
    print()
    print_head(f"{'cairn':<8} {'freeze':>7} {'memdump':>7} {'memwrite':>8} | {'dump':>6} "
               f"{'ingest':>6} {'hash':>6} {'rest':>6}",
               f"{'dump':<8} {'ms':>7} {'ms':>7} {'ms':>8} | {'s':>6} {'s':>6} {'s':>6} {'s':>6}")
    for s in sizes:
        b = s["breakdown"]
        print(f"{s['label']:<8} {b['cairn_freezing_ms']:>7.1f} {b['cairn_memdump_ms']:>7.1f} "
              f"{b['cairn_memwrite_ms']:>8.1f} | {b['cairn_dump_s']:>6.2f} "
              f"{b['cairn_ingest_s']:>6.2f} {b['cairn_ingest_hash_s']:>6.2f} "
              f"{b['cairn_ingest_rest_s']:>6.2f}")
    print("(CRIU's own stats inside the frozen time: freezing, page collection (memdump) and "
          "page writing (memwrite), which overlap; dump = the whole criu dump; ingest = hash "
          "(the store's chunk digests) + rest (read, dedup, pack writes, fsyncs, commit))")


def print_restores(sizes: list[dict[str, Any]]) -> None:
    print()
    print("restore of the last snapshot, cold cache: plain = criu restore from its disk "
          "directory; eager/copy/lazy = cairn.process.restore from the store (verified): eager "
          "streams the pages to criu --stream, copy fetches every image to a scratch first")
    print_head(f"{'size':<8} {'plain s':>7} {'eager s':>7} {'ratio':>6} {'copy s':>6} "
               f"{'ratio':>5} | {'fetch s':>7} {'criu s':>6} {'fetch':>6} {'strm':>6} "
               f"{'disk':>6} | {'lazy':>5} | "
               f"{'next step, runs s':>23} {'lazy':>5} | {'next step, random s':>23} "
               f"{'lazy':>5} | {'lazy all in s':>13} {'ok':>3}",
               f"{'':<8} {'':>7} {'':>7} {'':>6} {'':>6} {'':>5} | {'copy':>7} {'copy':>6} "
               f"{'MB/s':>6} {'MB/s':>6} "
               f"{'MB/s':>6} | {'runs':>5} | {'plain':>7} {'eager':>7} {'lazy':>7} "
               f"{'/plain':>5} | {'plain':>7} {'eager':>7} {'lazy':>7} {'/plain':>5} | "
               f"{'runs':>6} {'random':>6} {'':>3}")
    for s in sizes:
        r = s["restore"]
        b, n, nr, res = r["breakdown"], r["next_step_s"], r["next_step_runs_s"], r["resident_s"]

        def f(value: float | None, width: int, digits: int = 2) -> str:
            return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

        print(f"{s['label']:<8} {f(r['plain_s'], 7)} {f(r['eager_s'], 7)} "
              f"{f(r['eager_vs_plain'], 6)} {f(r['eager_copy_s'], 6)} "
              f"{f(r['eager_copy_vs_plain'], 5)} | {f(b['eager_copy_fetch_s'], 7)} "
              f"{f(b['eager_copy_criu_s'], 6)} {f(r['fetch_mbps'], 6, 0)} "
              f"{f(r['streamed_mbps'], 6, 0)} "
              f"{f(r['raw_disk_mbps'], 6, 0)} | {f(r['lazy_running_s'], 5)} | "
              f"{f(nr['plain'], 7)} {f(nr['eager'], 7)} {f(nr['lazy-runs'], 7)} "
              f"{f(r['lazy_next_step_vs_plain'], 5)} | {f(n['plain'], 7)} {f(n['eager'], 7)} "
              f"{f(n['lazy'], 7)} {f(r['lazy_random_next_step_vs_plain'], 5)} | "
              f"{f(res['lazy-runs'], 6)} {f(res['lazy'], 6)} "
              f"{'yes' if s['restore_verified'] else 'NO':>3}")
    print("(lazy runs: running after s; next step: from the restore's start until the workload "
          "has read 10% of its memory in 2 MiB runs (the target's case) or 10% of its pages "
          "at random; lazy / plain = lazy's next step / plain CRIU's restore; fetch MB/s: "
          "the copy's fetch into its scratch; strm MB/s: the image over eager's whole streamed "
          "restore; disk MB/s: the plain images read cold with 4 MiB reads; scratch: "
          + ", ".join(f"{s['label']} {s['restore']['scratch']}" for s in sizes) + ")")


def print_tables(sizes: list[dict[str, Any]], torch_out: dict[str, Any] | None,
                 args: argparse.Namespace, cold: bool, bandwidth: dict[str, Any]) -> None:
    print()
    print(f"process snapshots: per size {args.runs} dumps per side (first + {args.runs - 1} "
          f"after 10% changed in 64 KiB runs) + 1 after 10% scattered pages; "
          f"{args.restore_runs} restore(s) per side; medians")
    print_frozen(sizes, bandwidth)
    print()
    print_head(f"{'size':<8} {'durable s':>9} "
               f"{'durable s':>9} {'durable s':>9} {'durable s':>9}",
               f"{'':<8} {'plain 1st':>9} {'cairn 1st':>9} "
               f"{'plain con':>9} {'cairn con':>9}")
    for s in sizes:
        d = s["durable_s"]
        print(f"{s['label']:<8} {d['plain_first']:>9.2f} {d['cairn_first']:>9.2f} "
              f"{d['plain_consecutive']:>9.2f} {d['cairn_consecutive']:>9.2f}")
    print_restores(sizes)
    print()
    print_head(f"{'MB written':<8} {'image':>8} {'plain 1st':>9} {'cairn 1st':>9} | "
               f"{'plain con':>9} {'cairn con':>9} {'fraction':>8} | {'scattered':>9} "
               f"{'fraction':>8} | {'manifest':>8}",
               f"{'':<8} {'':>8} {'':>9} {'':>9} | {'':>9} {'':>9} {'':>8} | {'':>9} "
               f"{'':>8} | {'MiB/GiB':>8}")
    for s in sizes:
        b = s["bytes"]
        print(f"{s['label']:<8} {b['image_first'] / 1e6:>8.1f} {b['plain_first'] / 1e6:>9.1f} "
              f"{b['cairn_first'] / 1e6:>9.1f} | {b['plain_consecutive'] / 1e6:>9.1f} "
              f"{b['cairn_consecutive'] / 1e6:>9.1f} {s['consecutive_bytes_fraction']:>8.3f} | "
              f"{b['cairn_scattered'] / 1e6:>9.1f} {s['scattered_bytes_fraction']:>8.3f} | "
              f"{s['manifest_mib_per_gib']:>8.2f}")
    if torch_out is not None:
        t = torch_out
        print(f"{'torch':<8} {t['image_first'] / 1e6:>8.1f} {t['image_first'] / 1e6:>9.1f} "
              f"{t['cairn_first'] / 1e6:>9.1f} | {t['image_consecutive'] / 1e6:>9.1f} "
              f"{t['cairn_consecutive'] / 1e6:>9.1f} {t['consecutive_bytes_fraction']:>8.3f} |")
        print(f"(torch: criu_training.py, {t['processes']} processes, dumps {t['gap_s']:g}s "
              f"apart; frozen ms plain {'/'.join(f'{x:.0f}' for x in t['frozen_ms']['plain'])}, "
              f"cairn {'/'.join(f'{x:.0f}' for x in t['frozen_ms']['cairn'])})")
    print("(durable: plain = criu dump to disk + sync; cairn = dump + ingest into the store)")
    if not cold:
        print("NOTE: could not drop the page cache; restore figures are WARM-CACHE")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                        help="memory sizes of the workload (default 0.5G 1G 2G)")
    parser.add_argument("--runs", type=int, default=None,
                        help="dumps per side per size before the scattered one: the first + "
                             "runs-1 consecutive (default 3)")
    parser.add_argument("--restore-runs", type=int, default=None,
                        help="restores per side per size (default 3)")
    parser.add_argument("--torch-gap", type=float, default=None,
                        help="seconds between the two dumps of the training process (default 3)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch case")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 64M, 2 dumps per side, 1 restore per side, 1 s torch gap")
    parser.add_argument("--dir", default=None,
                        help="parent directory for the bench files (default: a temp dir under "
                             "/var/tmp); a fresh subdirectory is made and removed")
    args = parser.parse_args(argv)
    quick = args.quick
    if args.sizes is None:
        args.sizes = [64 << 20] if quick else [512 << 20, 1 << 30, 2 << 30]
    if args.runs is None:
        args.runs = 2 if quick else 3
    if args.restore_runs is None:
        args.restore_runs = 1 if quick else 3
    if args.torch_gap is None:
        args.torch_gap = 1.0 if quick else 3.0
    if args.runs < 2:
        parser.error("--runs must be at least 2 (a first and a consecutive dump)")
    if args.restore_runs < 1:
        parser.error("--restore-runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    criu = criu_mod.find_criu()
    if os.geteuid() != 0 or criu is None:
        print("process_bench needs root and a criu binary (make criu)", file=sys.stderr)
        return 2
    version = criu_mod.criu_version(criu)
    parent = args.dir or "/var/tmp"
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    need = 5 * max(args.sizes) + (1 << 30)
    if free < need:
        print(f"not enough free space in {parent}: {free / 1e9:.1f} GB free, "
              f"{need / 1e9:.1f} GB needed", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so every finally below kills what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_start = loadavg()
    root = tempfile.mkdtemp(prefix="cairn-process-bench-", dir=parent)
    shm_root = tempfile.mkdtemp(prefix="cairn-process-bench-", dir=staging_mod.SHM_DIR)

    def log(text: str) -> None:
        print(text, flush=True)

    encrypted = configured_secret() is not None  # cairn's stores are encrypted (ADR 0025)
    log(f"bench dir {root}; criu {criu} {'.'.join(map(str, version or ()))}; sizes "
        f"{', '.join(human(s) for s in args.sizes)}; runs {args.runs}; restore runs "
        f"{args.restore_runs}; load {load_start}; cairn's store "
        f"{'encrypted' if encrypted else 'unencrypted'}")
    cold = drop_caches()
    sizes: list[dict[str, Any]] = []
    torch_out: dict[str, Any] | None = None
    torch_note: str | None = None
    try:
        bandwidth = memory_bandwidth()
        log(f"memory bandwidth (memmove, best of {bandwidth['runs']}): 1 thread "
            f"{bandwidth['single_thread_gbps']:.2f} GB/s, {bandwidth['threads']} threads "
            f"{bandwidth['all_threads_gbps']:.2f} GB/s; the floor uses {bandwidth['config']}")
        for index, size in enumerate(args.sizes):
            sizes.append(bench_size(args, criu, root, shm_root, size, index, bandwidth, log))
        if args.no_torch:
            torch_note = "skipped (--no-torch)"
        else:
            try:
                import torch  # noqa: F401
            except ImportError:
                torch_note = "skipped: torch is not installed"
            else:
                torch_out = bench_torch(args, criu, root, shm_root, log)
        if torch_note:
            log(f"torch: {torch_note}")
    finally:
        Proc.kill_all()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)

    print_tables(sizes, torch_out, args, cold, bandwidth)
    figures = {
        "frozen_ratio": max(s["frozen_ratio"] for s in sizes),
        "consecutive_bytes_fraction": max(s["consecutive_bytes_fraction"] for s in sizes),
        "scattered_bytes_fraction": max(s["scattered_bytes_fraction"] for s in sizes),
        "manifest_mib_per_gib": max(s["manifest_mib_per_gib"] for s in sizes),
        "eager_restore_vs_plain": max(s["restore"]["eager_vs_plain"] for s in sizes),
        # The case: the largest process (2 GiB by default).
        "lazy_next_step_vs_plain": max(sizes, key=lambda s: s["size_bytes"])["restore"][
            "lazy_next_step_vs_plain"],
    }
    targets = {k: {"value": v, "target": TARGETS[k], "met": v <= TARGETS[k]}
               for k, v in figures.items()}
    print()
    print(f"{'target (worst size)':<28} {'value':>7} {'<=':>5}  met")
    for k, t in targets.items():
        print(f"{k:<28} {t['value']:>7.3f} {t['target']:>5.2f}  {'yes' if t['met'] else 'NO'}")
    print()
    out = {
        **figures,
        "encrypted_store": encrypted,
        "targets": targets,
        "restore_verified": all(s["restore_verified"] for s in sizes),
        "frozen_ratio_by_size": {s["label"]: s["frozen_ratio"] for s in sizes},
        "frozen_vs_floor": max(s["frozen_vs_floor"] for s in sizes),
        "frozen_vs_floor_by_size": {s["label"]: s["frozen_vs_floor"] for s in sizes},
        "floor_ms_by_size": {s["label"]: s["floor_ms"] for s in sizes},
        "plain_best_by_size": {s["label"]: s["plain_best"] for s in sizes},
        "cairn_staging_by_size": {s["label"]: s["cairn_staging"] for s in sizes},
        "memory_bandwidth": bandwidth,
        "consecutive_bytes_fraction_by_size": {s["label"]: s["consecutive_bytes_fraction"]
                                               for s in sizes},
        "scattered_bytes_fraction_by_size": {s["label"]: s["scattered_bytes_fraction"]
                                             for s in sizes},
        "manifest_mib_per_gib_by_size": {s["label"]: s["manifest_mib_per_gib"] for s in sizes},
        "eager_restore_vs_plain_by_size": {s["label"]: s["restore"]["eager_vs_plain"]
                                           for s in sizes},
        "lazy_next_step_vs_plain_by_size": {s["label"]: s["restore"]["lazy_next_step_vs_plain"]
                                            for s in sizes},
        "lazy_random_next_step_vs_plain": max(sizes, key=lambda s: s["size_bytes"])["restore"][
            "lazy_random_next_step_vs_plain"],
        "lazy_random_next_step_vs_plain_by_size": {
            s["label"]: s["restore"]["lazy_random_next_step_vs_plain"] for s in sizes},
        "lazy_resident_s_by_size": {s["label"]: s["restore"]["resident_s"]["lazy"]
                                    for s in sizes},
        "lazy_runs_resident_s_by_size": {s["label"]: s["restore"]["resident_s"]["lazy-runs"]
                                         for s in sizes},
        "restore_fetch_mbps_by_size": {s["label"]: s["restore"]["fetch_mbps"] for s in sizes},
        "restore_streamed_mbps_by_size": {s["label"]: s["restore"]["streamed_mbps"]
                                          for s in sizes},
        "eager_copy_restore_vs_plain_by_size": {s["label"]: s["restore"]["eager_copy_vs_plain"]
                                                for s in sizes},
        "eager_streamed": all(s["restore"]["eager_streamed"] for s in sizes),
        "raw_disk_mbps_by_size": {s["label"]: s["restore"]["raw_disk_mbps"] for s in sizes},
        "torch": torch_out if torch_out is not None else {"skipped": torch_note},
        "sizes": sizes,
        "runs": args.runs,
        "restore_runs": args.restore_runs,
        "quick": args.quick,
        "change": {"fraction": FRACTION, "run_bytes": RUN_BYTES},
        "next_step": {"fraction": FRACTION, "run_bytes": TOUCH_RUN_BYTES},
        "page_chunk_bytes": PAGE_CHUNK,
        "criu": ".".join(map(str, version or ())),
        "cold_cache": cold,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }
    print(json.dumps(out))
    return 0 if out["restore_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
