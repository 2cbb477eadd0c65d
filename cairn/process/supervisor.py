"""``cairn run``: run an unmodified command, snapshot it with CRIU, resume it after a kill.

The supervisor is the command's parent for its whole life:

* at start it opens an attempt on KEY (fencing any older one) and restores the newest
  committed snapshot whose compatibility record matches this host and workload, or starts the
  command fresh, saying which and why;
* the workload's stdout and stderr go to supervisor-owned log files (echoed to the
  supervisor's own stdout/stderr), stored with each snapshot and cut back to their dumped size
  before a restore;
* every ``every`` seconds it dumps the workload with CRIU to local staging (the workload is
  frozen only while CRIU writes its pages), lets it run again, and ingests the images into the
  store; with ``spool_dir`` (Kubernetes: ``cairn run --spool``) it dumps into an entry of the
  spool instead and the sidecar's uploader commits it (:mod:`cairn.process.spool`, ADR 0014),
  so a snapshot costs the supervisor only the dump;
* the workload never outlives the supervisor: a fresh child gets ``PR_SET_PDEATHSIG=SIGKILL``
  and a restored one keeps it, because CRIU restores it as the supervisor's child
  (``--restore-sibling``); the supervisor is also a child subreaper;
* SIGTERM/SIGINT, or a notice file written by the Kubernetes sidecar (``notice_file``, see
  :mod:`cairn.runtime.channel`): a final dump (which stops the workload) only if the last measured
  snapshot cost fits the budget — what is left of the grace, and of the notice's deadline; the
  exit code says whether it was committed;
* a suspend request for its try (``cairn suspend``; polled every ``suspend_poll_s``, see
  :mod:`cairn.runtime.suspend`): a final dump that stops the workload, within the grace, then
  exit 77 (``suspended``); a failed dump leaves the workload running and is tried again at the
  next poll. While the key is held suspended a new run stops before it starts (exit 77);
* with ``status_file`` it reports its counters there after each snapshot (the sidecar serves
  them as metrics);
* when the command succeeds the key is marked done and its snapshots dropped (spooled entries
  not yet uploaded are cancelled first: they would be dropped anyway).

Exit codes (:mod:`cairn.runtime.exits`): the workload's own when it ends by itself (128 + N
when killed by signal N); 75/76 preempted with / without a final snapshot; 77 suspended; 2
(usage), 5
(fenced), 6 (storage) and 7 (host not ready). Only the main thread forks (a parent-death signal follows
the *thread* that forked).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import (
    CairnError,
    ConfigError,
    CorruptSnapshot,
    CriuFailed,
    Fenced,
    NotFound,
    NotSnapshottable,
    ProcessError,
    RestoreFailed,
    StoreError,
)
from cairn.process import compat as compat_mod
from cairn.process import criu as criu_mod
from cairn.process import cuda as cuda_mod
from cairn.process import gpu_budget
from cairn.process import gpu_map as gpu_map_mod
from cairn.process import gpu_refusals
from cairn.process import gpus as gpus_mod
from cairn.process import pids as pids_mod
from cairn.process import snapshot as snap_mod
from cairn.process import spool as spool_mod
from cairn.process import restore as restore_mod
from cairn.process import staging as staging_mod
from cairn.process import torch_shm, workload
from cairn.process.doctor import Preflight
from cairn.process.images import read_dump_stats, read_unix_socket_paths
from cairn.process.log_echo import LogEcho
from cairn.process.spool_client import SpoolClient
from cairn.runtime.stores import open_store
from cairn.store import Key, Manifest, SnapshotMode, Store, store_kind
from cairn.runtime import channel, env, session
from cairn.runtime import suspend as suspend_mod
from cairn.runtime.budget import UNMEASURED_BYTES_PER_S, FinalBudget, estimate_unmeasured
from cairn.runtime.endings import record_exit
from cairn.runtime.exits import ExitCode, from_wait_status
from cairn.runtime.wakeup import Wakeup
from cairn.store.hashing import digest
from cairn.store.verdicts import as_read_failure, reading

log = logging.getLogger("cairn.run")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_WORKDIR: str = env.WORKDIR.default  # type: ignore[assignment]
DUMP_TIMEOUT_S = 900.0  # a CRIU dump that hangs this long is killed (the workload thaws)
FINAL_DUMP_MIN_TIMEOUT_S = 1.0  # a final dump runs until the budget ends, but at least this
PID_WAIT_S = 30.0  # how long a restore waits for a killed predecessor's PIDs to be freed
SOCKET_DIR_PARENTS = ("/tmp", "/var/tmp", "/dev/shm")  # where a restore may make a socket's dir
SPOOL_EXIT_MARGIN_S = 0.5  # a final upload is awaited until this long before the budget ends
# A platform that signals every process of the step (SLURM's proctrack, a process group) may
# kill the workload a moment before this run's own signal arrives: wait this long for it.
STOP_SIGNAL_WAIT_S = 0.5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class OnSuccess(str, enum.Enum):
    """What happens to the key's snapshots once the command exits 0."""

    DROP = "drop"  # mark the key done and delete its snapshots
    KEEP = "keep"  # leave them (a later run of the same key starts from the last one)


@dataclass(frozen=True)
class RunSettings:
    store: str
    key: str
    argv: tuple[str, ...]
    every_s: float | None = 600.0  # None: no periodic snapshots (only the final one)
    grace_s: float = 30.0
    workdir: str = DEFAULT_WORKDIR
    ghost_limit: int = criu_mod.DEFAULT_GHOST_LIMIT
    on_success: OnSuccess = OnSuccess.DROP
    preflight: bool = True
    echo: bool = True  # copy the workload's output to the supervisor's stdout/stderr
    notice_file: str | None = None  # polled for a sidecar's preemption notice (k8s)
    status_file: str | None = None  # written after each snapshot, for the sidecar's metrics
    exclude_seqs: frozenset[int] = frozenset()  # never restored (a resume policy's verdict)
    spool_dir: str | None = None  # hand dumps to `cairn sidecar --upload` here (k8s)
    spool_wait_s: float = 60.0  # at start: wait this long for an earlier run's spooled dumps
    # Where a dump stages without a spool (checked per dump; cairn.process.staging, ADR 0020).
    staging: staging_mod.StagingMedium = staging_mod.StagingMedium.AUTO
    # How a snapshot is restored (cairn.process.restore, ADR 0021).
    restore: restore_mod.RestoreMode = restore_mod.RestoreMode.EAGER
    suspend_poll_s: float = 5.0  # how often the store is read for a suspend request
    # A fresh workload starts with SIGTERM ignored (SLURM signals every process of a job; the
    # supervisor alone answers a SIGTERM, with the final snapshot: cairn.runtime.slurm).
    workload_ignores_sigterm: bool = False


    def __post_init__(self) -> None:
        if not self.argv:
            raise ConfigError("give the command to run after --, e.g. cairn run --store S "
                              "--key K -- python train.py")
        if self.grace_s < 0:
            raise ConfigError("--grace must be zero or more seconds")
        if self.spool_wait_s < 0:
            raise ConfigError("--spool-wait must be zero or more seconds")
        if self.suspend_poll_s <= 0:
            raise ConfigError("--suspend-poll must be a positive duration")
        if not isinstance(self.restore, restore_mod.RestoreMode):
            raise ConfigError(f"restore={self.restore!r}: give a RestoreMode (parse text with "
                              "RestoreMode.parse)")
        if not isinstance(self.staging, staging_mod.StagingMedium):
            raise ConfigError(f"staging={self.staging!r}: give a StagingMedium (parse text with "
                              "StagingMedium.parse)")


@dataclass
class DumpCost:
    """What the last snapshot cost, to decide whether a final one fits the grace budget."""

    seconds: float | None = None
    peak_staging_bytes: int = 0
    failures: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Saved:
    """A snapshot taken: committed as ``seq``, or spooled as ``entry`` for the uploader."""

    seq: int | None = None
    entry: str | None = None


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _gpu_text(figures: Mapping[str, float]) -> str:
    """The GPU stall (lock -> unlock) for a snapshot's log line, beside CRIU's frozen time,
    with its lock and checkpoint (device-to-host copy) parts."""
    if not figures.get("gpu_stall_ms"):
        return ""
    return (f", GPU stalled {figures['gpu_stall_ms']:.0f} ms (lock to unlock; lock "
            f"{figures.get('gpu_lock_s', 0) * 1000:.0f} ms + checkpoint "
            f"{figures.get('gpu_checkpoint_s', 0) * 1000:.0f} ms)")


def unauthenticated_root_restore(store: Store, *, euid: int | None = None,
                                 environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``cairn run`` must not use ``store``, or None. As root, a process restore runs
    whatever the snapshot holds with root's rights; from an unencrypted bucket that is
    whoever can write the bucket's choice (ADR 0025), unless the operator opted out."""
    if (euid if euid is not None else os.geteuid()) != 0 or store.encrypted:
        return None
    if not store_kind(store.url).remote or env.ALLOW_UNAUTHENTICATED_RESTORE.get(environ) == "1":
        return None
    return (f"refusing to run as root on the unencrypted store {store.url}: a restore would run "
            "as root whatever anyone who can write the bucket put in a snapshot. Use an "
            f"encrypted store (set {env.SECRET_FILE} when it is created; see "
            f"docs/encryption.md), or set {env.ALLOW_UNAUTHENTICATED_RESTORE}=1 to accept that")


def _describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "gone"
    return "a zombie not yet reaped" if state == "Z" else (cmd[:80] or "?")


class Supervisor:
    """One ``cairn run``. Construct, then :meth:`run` (main thread only) for the exit code."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.key = Key.parse(settings.key)
        self.cwd = os.getcwd()
        # Resolved: CRIU records open files by their real path, which is how logs are matched.
        self.run_dir = os.path.join(os.path.realpath(settings.workdir),
                                    digest(self.key.path.encode())[:16])
        self.stdout_path = os.path.join(self.run_dir, "stdout.log")
        self.stderr_path = os.path.join(self.run_dir, "stderr.log")
        self.staging = os.path.join(self.run_dir, "staging")
        # Where dumps stage when the policy picks memory (made at the first such dump).
        self._memory_staging = staging_mod.memory_parent(self.run_dir, self.staging)
        self._memory_ready = False
        self._staging_medium: staging_mod.StagingMedium | None = None  # the last dump's
        # Where tracked files may live and be restored (the working and run directories and
        # $CAIRN_TRACK_ROOTS): checked before each dump, enforced by each restore.
        self._track_roots = snap_mod.track_roots(log_dir=self.run_dir, cwd=self.cwd)
        self.cost = DumpCost()
        self.child: int | None = None
        self.restored_from: int | None = None
        # The restore in progress: a lazy one until every page is in (no dump before that).
        self._restored: restore_mod.Restored | None = None
        self._failed_seqs: set[int] = set()  # lazy restores that failed verification
        self._wake = Wakeup()  # raised by the signal handlers (see cairn.runtime.wakeup for why a pipe)
        self._signal: int | None = None
        self._signal_at = 0.0
        self._criu: str | None = None
        # Whether CRIU can serve pages lazily here: asked while the store opens when the
        # settings want lazy restores, else when a restore asks.
        self._uffd_ok: Callable[[], bool] = lambda: criu_mod.has_feature(
            self._criu or "criu", "uffd-noncoop")
        self._store: Store | None = None
        self._attempt: Any = None
        self._compat: dict[str, Any] = {}
        self._echo: LogEcho | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._cuda: cuda_mod.CudaCheckpoint | bool | None = None  # False: no driver here
        self._gpu_use: gpus_mod.GpuUse | None = None  # the workload's, at the last dump check
        self._notice: channel.Notice | None = None
        self._status = channel.RunStatus(pid=os.getpid(), started_at=time.time())
        self._status_failed = False
        self._spool: SpoolClient | None = None
        self._suspend: suspend_mod.SuspendWatch | None = None
        self._suspend_detail: dict[str, Any] = {}  # the request honoured, for the outcome
        self._cause: channel.Cause | None = None  # the sidecar's answer to our SIGTERM
        # Workload run time carried by the snapshots, so a resume can say how much it saved.
        self._runtime_base = 0.0
        self._runtime_since = time.monotonic()

    # -- signals ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._signal is None:
            self._signal, self._signal_at = signum, time.monotonic()
        self._wake.set()

    def _on_child(self, _signum: int, _frame: object) -> None:
        self._wake.set()

    # -- entry point -----------------------------------------------------------------------

    def _read_ahead(self) -> None:
        """Read and parse the key's snapshot records while the host checks run on their
        thread: reads only, and the slot log keeps what it parsed, so opening the attempt and
        choosing the snapshot parse nothing again (a 1 GiB image's manifest takes ~0.1 s). A
        failure is left for those steps to meet and report."""
        assert self._store is not None
        with contextlib.suppress(CairnError, OSError):
            self._store.snapshots(self.key)

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def run(self) -> int:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("Supervisor.run() must be called from the main thread")
        s = self.settings
        try:
            done = pids_mod.make_cursor_writable()
            if done:
                log.warning("%s", done)
        except OSError as e:
            log.warning("cannot make /proc/sys writable (%s); the workload will start at a low "
                        "PID that a restore in a fresh container may find taken", e)
        # After the cursor is made writable (a mount namespace of this thread's, which the
        # checks' thread must see), and beside the store's opening and read-ahead.
        preflight = Preflight() if s.preflight else None
        unopened: StoreError | None = None
        try:
            self._store = open_store(s.store)
        except StoreError as e:
            unopened = e  # reported once the host checks have had their say
        else:
            if preflight is not None:
                self._read_ahead()
        if preflight is not None:
            report = preflight.report()
            if not report.ok:
                log.error("this host cannot run process mode:\n%s", report.format_text())
                self._close_store()
                return ExitCode.NOT_READY
        try:
            self._criu = criu_mod.find_criu()
        except ConfigError as e:
            log.error("%s", e)
            self._close_store()
            return ExitCode.NOT_READY
        if s.restore is restore_mod.RestoreMode.LAZY:
            self._uffd_ok = criu_mod.probe_feature(self._criu, "uffd-noncoop")
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGCHLD, self._on_child)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        os.makedirs(self.run_dir, exist_ok=True)
        if s.spool_dir:
            try:
                self._spool = SpoolClient.prepare(s.spool_dir, wait_s=s.spool_wait_s,
                                                  account=self._account_upload)
            except (CairnError, OSError) as e:
                log.error("cannot use the spool %s: %s", s.spool_dir, e)
                self._close_store()
                return ExitCode.USAGE
        if unopened is not None:
            log.error("cannot open the store: %s", unopened)
            return ExitCode.STORAGE
        assert self._store is not None
        try:
            refusal = unauthenticated_root_restore(self._store)
            if refusal is not None:
                log.error("%s", refusal)
                self._store.close()
                return ExitCode.USAGE
            held = suspend_mod.held(self._store, self.key)
            if held is not None:  # before the attempt opens: nothing is fenced or restored
                log.error("%s", held)
                self._store.close()
                return ExitCode.SUSPENDED
            self._attempt = self._store.open_attempt(
                self.key, note={"mode": "process", "host": os.uname().nodename,
                                "argv": list(s.argv)}, exclude=s.exclude_seqs)
            if self._spool is not None:
                self._spool.epoch = self._attempt.epoch
            self._suspend = suspend_mod.SuspendWatch(self._store, self.key,
                                                     epoch=self._attempt.epoch,
                                                     interval_s=s.suspend_poll_s)
        except StoreError as e:
            log.error("cannot open the store: %s", e)
            return ExitCode.STORAGE
        self._compat = compat_mod.current_record(s.argv, cwd=self.cwd, criu=self._criu)
        code: int | None = None
        try:
            code = self._supervise()
            return code
        except RestoreFailed as e:  # nothing was skipped: the snapshots stay for the retry
            log.error("%s (exit %d)", e, ExitCode.RESTORE_FAILED, exc_info=e.__cause__ or e)
            code = ExitCode.RESTORE_FAILED
            return code
        finally:
            if self._echo is not None:
                self._echo.stop()
            self._poll_spool()
            self._summarize()
            if self.child is not None:
                self._kill_child()
            if self._restored is not None:
                self._restored.close()
            shutil.rmtree(self.staging, ignore_errors=True)
            # Also what a killed run of this key left in RAM when this one never staged there.
            staging_mod.remove_private_dir(self._memory_staging)
            self._record_outcome(code)
            self._store.close()
            self._wake.close()

    def _supervise(self) -> int:
        s = self.settings
        offsets = self._start_workload()
        self._runtime_since = time.monotonic()
        if self.restored_from is not None:
            self._report(resumes=1, work_saved_seconds=self._runtime_base)
        else:
            self._report()
        if s.echo:
            self._echo = LogEcho([(self.stdout_path, sys.stdout.buffer),
                                   (self.stderr_path, sys.stderr.buffer)])
            self._echo.start_at(offsets)
        next_dump = time.monotonic() + s.every_s if s.every_s else None
        while True:
            status = self._reap()
            if self._lazy_failed():
                offsets = self._restart_after_lazy_failure()
                continue
            if status is not None:
                if self._stopped_with_the_run(status):
                    asked = self._ask_cause()
                    return self._classify(self._workload_stopped_too(status), asked)
                return self._workload_ended(status)
            if self._signal is not None or self._take_notice():
                asked = self._ask_cause()
                return self._classify(self._preempted(), asked)
            if self._suspend is not None and self._suspend.poll() is not None:
                code = self._suspended()
                if code is not None:
                    return code
            self._poll_spool()
            if self._spool is not None and self._spool.fenced is not None:
                log.error("the uploader could not commit entry %s: %s; stopping the workload",
                          self._spool.fenced.entry, self._spool.fenced.detail)
                return ExitCode.FENCED
            now = time.monotonic()
            if next_dump is not None and now >= next_dump and self._pages_outstanding():
                next_dump = now + 1.0  # a half-filled process is not a snapshot
                continue
            if next_dump is not None and now >= next_dump and self._spool_busy():
                next_dump = now + 1.0  # the previous dump is still being uploaded
                continue
            if next_dump is not None and now >= next_dump:
                try:
                    self._snapshot(leave_running=True)
                except Fenced as e:
                    log.error("%s; stopping the workload", e)
                    return ExitCode.FENCED
                next_dump = time.monotonic() + s.every_s  # type: ignore[operator]
                continue
            timeout = 1.0 if next_dump is None else min(1.0, max(0.0, next_dump - now))
            self._wake.wait(timeout)

    # -- starting: restore or fresh --------------------------------------------------------

    def _start_workload(self) -> dict[str, int]:
        """Restore or start the workload; returns the log offsets already shown. Only a store
        verdict (CorruptSnapshot) skips a snapshot; CRIU's or the host's failure (CriuFailed,
        OSError) starts fresh; any other failure raises RestoreFailed, skipping nothing."""
        assert self._store is not None
        reason = None
        snapshots = [i for i in self._store.snapshots(self.key)
                     if i.manifest.mode is SnapshotMode.PROCESS
                     and i.seq not in self.settings.exclude_seqs
                     and i.seq not in self._failed_seqs]
        for info in snapshots:
            manifest = info.manifest
            differences = compat_mod.differences(manifest.metadata.get("compat") or {},
                                                 self._compat, gpu_map=self._gpu_map())
            if differences:
                reason = (f"snapshot seq {manifest.seq} does not fit: " + "; ".join(differences))
                break
            try:
                with reading(manifest.seq):  # a RestoreFailed ends the try: nothing skipped
                    tracked = self._restore(manifest)
                assert self._restored is not None  # set by _restore
                log.warning("restored snapshot seq %d of key %s (pid %d), %s", manifest.seq,
                            self.key, self.child, self._restored.how)
                self.restored_from = manifest.seq
                # Echo from the dumped sizes: the restored workload is already writing.
                return {t.path: t.size for t in tracked
                        if t.path in (self.stdout_path, self.stderr_path)}
            except CorruptSnapshot as e:
                log.warning("skipping snapshot seq %d: %s", manifest.seq, e)
                reason = f"no snapshot verifies (last tried seq {manifest.seq}: {e})"
            except (CriuFailed, OSError) as e:
                reason = f"restoring seq {manifest.seq} failed: {e}"
                log.error("%s", reason)
                break
        if not snapshots:
            reason = f"key {self.key} has no process snapshot"
        log.warning("starting fresh: %s", reason)
        self._spawn_fresh()
        return {}

    def _wait_for_pids(self, manifest: Manifest) -> None:
        """CRIU needs the snapshot's PIDs free. A killed predecessor's processes may still be
        exiting, or be zombies the container's init has yet to reap: wait for them a while,
        then name whatever still holds a PID."""
        wanted = [int(p) for p in snap_mod.process_info(manifest).get("pids", [])]
        deadline = time.monotonic() + PID_WAIT_S
        while True:
            taken = [p for p in wanted if os.path.exists(f"/proc/{p}")]
            if not taken:
                return
            if time.monotonic() > deadline:
                holders = ", ".join(f"{p} ({_describe_pid(p)})" for p in taken[:5])
                raise CriuFailed(f"the snapshot's PIDs are still in use after {PID_WAIT_S:.0f}s: "
                                 f"{holders}; stop those processes, or run the step on another "
                                 "worker")
            time.sleep(0.1)

    def _restore(self, manifest: Manifest) -> list[snap_mod.TrackedFile]:
        """Fetch and restore ``manifest`` (:mod:`cairn.process.restore`); returns the tracked
        files as put back. A lazy restore is left in ``self._restored`` until every page is
        in."""
        assert self._store is not None and self._criu is not None
        self._wait_for_pids(manifest)
        os.makedirs(self.staging, exist_ok=True)  # the pid file's directory
        pidfile = os.path.join(self.staging, "restored.pid")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)  # an earlier restore's (CRIU refuses to overwrite it)
        scratch = os.path.join(self._restore_parent(manifest), f"restore-{manifest.seq}")
        shutil.rmtree(scratch, ignore_errors=True)
        mode = self.settings.restore
        restored = restore_mod.restore(
            self._store, manifest, criu=self._criu, scratch=scratch,
            pidfile=pidfile, roots=self._track_roots,
            mode=mode, prepare=self._prepare_restore, kill_tree=self._kill_restored_tree,
            uffd_ok=mode is not restore_mod.RestoreMode.LAZY or self._uffd_ok())
        self.child = restored.pid
        self._restored = restored
        tracked = restored.tracked
        gpu = [int(p) for p in snap_mod.process_info(manifest).get("gpu_pids", [])]
        if gpu:
            api = self._cuda_api()
            if api is None:
                raise CriuFailed("the snapshot holds GPU state and libcuda cannot be loaded here")
            plan = compat_mod.gpu_plan(manifest.metadata.get("compat") or {}, self._compat,
                                       gpu_map=self._gpu_map())
            if plan.pairs:
                log.warning("restoring the GPU state onto other GPUs: %s",
                            ", ".join(f"{o} -> {n}" for o, n in plan.pairs))
            try:
                cuda_mod.resume_restored(api, gpu, pairs=plan.pairs)
            except ProcessError as e:
                # CRIU put the tree back, the driver did not: it cannot run. Kill it.
                self._kill_restored_tree(self.child)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.child, 0)
                raise CriuFailed(f"the GPU state did not come back: {e}") from e
        self._attempt.resume_from(manifest)
        self._runtime_base = float(snap_mod.process_info(manifest).get("runtime_s") or 0.0)
        tree = workload.process_tree(self.child)
        try:
            pids_mod.advance_past(tree)
        except OSError as e:
            log.warning("cannot move ns_last_pid past the restored PIDs (%s); the workload's "
                        "new children may get low PIDs", e)
        return tracked

    def _restore_parent(self, manifest: Manifest) -> str:
        """Where a restore's scratch copy goes: where the staging policy
        (``RunSettings.staging``) would put an image of the copy and the restored process
        together."""
        choice = restore_mod.scratch_choice(self.settings.staging, manifest,
                                            memory_dir=self._memory_staging,
                                            disk_dir=self.staging)
        choice = self._usable(choice, strict=False, instead="restoring through the disk instead")
        log.info("restore scratch at %s (%s; the copy and the restored process)", choice.parent,
                 choice.reason)
        return choice.parent

    def _usable(self, choice: staging_mod.StagingChoice, *, strict: bool,
                instead: str) -> staging_mod.StagingChoice:
        """``choice`` with its parent made: the memory directory is prepared once per run (a
        killed run's leftovers go); where it cannot be, the disk instead (logged with
        ``instead``), or, when ``strict``, the ConfigError."""
        if choice.parent == self._memory_staging and not self._memory_ready:
            try:
                staging_mod.prepare_private_dir(choice.parent)
                self._memory_ready = True
            except ConfigError as e:
                if strict:
                    raise
                log.warning("%s; %s", e, instead)
                choice = dataclasses.replace(choice, parent=self.staging,
                                             medium=staging_mod.StagingMedium.DISK)
        os.makedirs(choice.parent, exist_ok=True)
        return choice

    def _prepare_restore(self, image_dir: str) -> Callable[[], None]:
        """What a restore needs besides its images; returns what undoes it."""
        for socket_path in read_unix_socket_paths(image_dir):
            self._prepare_socket_dir(socket_path)
        shm_files = torch_shm.recreate(image_dir)
        return lambda: torch_shm.remove(shm_files)

    def _kill_restored_tree(self, root: int) -> None:
        """Kill the tree a lazy restore is still filling (from its threads: signals only)."""
        for pid in reversed(workload.process_tree(root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _pages_outstanding(self) -> bool:
        """Whether a lazy restore is still filling the workload's memory."""
        if self._restored is None:
            return False
        if self._restored.finished:
            lazy = self._restored.lazy
            if lazy is not None and lazy.failure is None:
                st = lazy.stats
                log.warning("lazy restore complete: every page in after %.2fs (running after "
                            "%.2fs); %.1f MB served in %d requests", st.resident_s or 0.0,
                            st.restored_s, st.bytes_served / 1e6, st.requests)
            if lazy is None or lazy.failure is None:
                self._restored = None
            return False
        return True

    def _lazy_failed(self) -> bool:
        restored = self._restored
        if restored is None or restored.lazy is None:
            return False
        restored.lazy.poll()  # a handler that stopped early sets the failure (and kills the tree)
        return restored.lazy.failure is not None

    def _restart_after_lazy_failure(self) -> dict[str, int]:
        """A lazy restore failed (a chunk did not verify, or its handler failed): its tree is
        killed; reap it and start again from the previous snapshot (or fresh). A failure of
        the reading on this side raises RestoreFailed instead: no snapshot is skipped."""
        assert self._restored is not None and self._restored.lazy is not None
        seq, failure = self.restored_from, self._restored.lazy.failure
        assert failure is not None  # _lazy_failed() said so
        failure = as_read_failure(failure, seq=seq)
        log.error("the restore of snapshot seq %s failed while the workload ran: %s; it was "
                  "stopped, %s", seq, failure, "exiting" if isinstance(failure, RestoreFailed)
                  else "trying the previous snapshot")
        self._restored.close()
        self._restored = None
        if seq is not None:
            self._failed_seqs.add(seq)
        deadline = time.monotonic() + PID_WAIT_S
        while self.child is not None and time.monotonic() < deadline:
            self._kill_restored_tree(self.child)
            if self._reap() is None:
                time.sleep(0.05)
        if self._echo is not None:
            self._echo.stop()
            self._echo = None
        if isinstance(failure, RestoreFailed):
            raise failure
        self.restored_from = None
        offsets = self._start_workload()
        if self.settings.echo:
            self._echo = LogEcho([(self.stdout_path, sys.stdout.buffer),
                                  (self.stderr_path, sys.stderr.buffer)])
            self._echo.start_at(offsets)
        return offsets

    def _spawn_fresh(self) -> None:
        s = self.settings
        for path in (self.stdout_path, self.stderr_path):
            open(path, "wb").close()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the log (and the echo) at once
        supervisor = os.getpid()

        def in_child() -> None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if s.workload_ignores_sigterm:  # inherited through exec, kept by a restore
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if os.getppid() != supervisor:  # the supervisor died before prctl took effect
                os._exit(1)

        def spawn() -> subprocess.Popen[bytes]:
            # O_APPEND: CRIU then records the position, and cairn can cut the file back.
            with open(self.stdout_path, "ab") as out, open(self.stderr_path, "ab") as err:
                return subprocess.Popen(list(s.argv), stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True, env=env,
                                        preexec_fn=in_child)

        try:
            proc = pids_mod.spawn_at(pids_mod.high_pid_base(), spawn)
        except OSError as e:
            if isinstance(e, (FileNotFoundError, PermissionError)) and e.filename == s.argv[0]:
                raise ConfigError(f"cannot run {s.argv[0]!r}: {e.strerror}") from None
            log.warning("cannot move ns_last_pid (%s); the workload starts at a low PID that "
                        "a restore in a fresh container may find taken", e)
            proc = spawn()
        self._proc = proc  # held so that subprocess never reaps it behind waitpid's back
        self.child = proc.pid
        log.warning("started %s (pid %d)", " ".join(s.argv), self.child)

    # -- snapshots ------------------------------------------------------------------------

    def _check_dumpable(self, tree: list[int]) -> tuple[list[str], list[int]]:
        """Refuse what CRIU could not restore. Returns the append-mode files to track and the
        processes holding CUDA state."""
        files = workload.open_files(tree)
        own = {self.stdout_path, self.stderr_path}
        problems = workload.rewritten_files(files) + workload.established_tcp(files)
        gpu: list[int] = []
        if workload.gpu_pids(tree):
            api = self._cuda_api()
            if api is None:
                problems.append(workload.Problem(
                    what="the workload maps an NVIDIA device but libcuda cannot be loaded here",
                    fix="run where the NVIDIA driver (>= 570) is installed, or use state mode "
                        "(cairn.Checkpointer)"))
            else:
                gpu = cuda_mod.cuda_pids(api, tree)
                if gpu:
                    inventory = gpus_mod.inventory()
                    self._gpu_use = inventory.use_of(tree)
                    problems += gpu_refusals.problems(tree, files, cuda_pids=gpu,
                                                      inventory=inventory, use=self._gpu_use)
                    if not problems:
                        cuda_mod.check_fits(self._gpu_use.total,
                                            device_wide=not self._gpu_use.matched)
        if not gpu:  # RDMA devices and NCCL's or CUDA's shared memory, whatever the driver says
            problems += gpu_refusals.problems(tree, files, cuda_pids=[])
        if problems:
            raise NotSnapshottable("cannot snapshot the workload:\n  " +
                                   "\n  ".join(str(p) for p in problems))
        tracked = sorted(own) + [p for p in workload.append_files(files) if p not in own]
        snap_mod.check_tracked(tracked, roots=self._track_roots)  # before, not after, the dump
        return tracked, gpu

    def _prepare_socket_dir(self, socket_path: str) -> None:
        """Create the directory of a unix socket the images name, which CRIU needs to exist
        (multiprocessing's ``/tmp/pymp-*``, say). The images are not trusted: only one new
        directory, mode 0700, directly in a temporary directory or a track root, made without
        following a symlink (a symlinked parent raises OSError: the restore fails); anything
        else is left to CRIU to refuse."""
        directory = os.path.dirname(socket_path)
        parent, name = os.path.split(directory)
        if os.path.isdir(directory) and not os.path.islink(directory):
            return
        if (parent not in SOCKET_DIR_PARENTS and parent not in self._track_roots) \
                or name in ("", ".", "..") or os.path.normpath(directory) != directory:
            log.warning("not creating %s for a unix socket the snapshot names: only a new "
                        "directory directly in %s or a track root is made", directory,
                        ", ".join(SOCKET_DIR_PARENTS))
            return
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
        finally:
            os.close(fd)

    def _gpu_map(self) -> dict[str, str]:
        """``CAIRN_GPU_MAP``, parsed (a malformed one raises ConfigError)."""
        return gpu_map_mod.parse_gpu_map(env.GPU_MAP.get())

    def _cuda_api(self) -> cuda_mod.CudaCheckpoint | None:
        if self._cuda is None:
            self._cuda = cuda_mod.CudaCheckpoint.load() or False
        return self._cuda or None

    def _dump_dir(self, tree: list[int], gpu: list[int]) -> str:
        """A new, empty directory for this dump's images, where the staging policy puts it
        (``RunSettings.staging``, checked per dump against the last image; before the first
        dump the workload's resident memory, plus the GPU memory the driver will copy into it,
        stands in; that copy also takes from the memory a staged image could have). Said at
        WARNING when the medium changes, else at INFO."""
        last = next((h["image_bytes"] for h in reversed(self.cost.history)
                     if h.get("entry") is None), None)
        estimate = None
        if last is None:
            estimate = workload.resident_bytes(tree) + (
                self._gpu_use.total if gpu and self._gpu_use else 0)
        headroom = None
        if gpu and self._gpu_use:  # the GPU copy lands in the same memory as a tmpfs image
            headroom = staging_mod.after_gpu_copy(
                staging_mod.memory_headroom(self._memory_staging), self._gpu_use.total)
        choice = staging_mod.choose_staging(self.settings.staging, image_bytes=last,
                                            estimate_bytes=estimate,
                                            memory_dir=self._memory_staging,
                                            disk_dir=self.staging, headroom=headroom)
        level = logging.INFO if choice.medium is self._staging_medium else logging.WARNING
        log.log(level, "staging the dump %s at %s (%s)",
                "in memory" if choice.medium is staging_mod.StagingMedium.MEMORY else "on disk",
                choice.parent, choice.reason)
        choice = self._usable(choice, strict=self.settings.staging is not
                              staging_mod.StagingMedium.AUTO, instead="staging on disk instead")
        self._staging_medium = choice.medium
        image_dir = os.path.join(choice.parent, f"dump-{int(time.time() * 1000)}")
        os.mkdir(image_dir, 0o700)
        return image_dir

    def _snapshot(self, *, leave_running: bool,
                  timeout: float = DUMP_TIMEOUT_S) -> _Saved | None:
        """Dump, then ingest (or, with a spool, hand the dump to the uploader). Returns what
        was saved, or None when it failed (logged; the workload keeps running when
        ``leave_running``). A dump still running after ``timeout`` seconds is killed (a
        failure). Raises Fenced.

        Without a spool the dump stages where :meth:`_dump_dir` puts it (memory or disk, per
        ``RunSettings.staging``) and is removed once ingested. With a spool it goes into the
        spool's entry, whatever the policy: the sidecar reads it from there, so the spool's
        volume is the medium (on Kubernetes the pod transform's ``emptyDir``, memory-backed and
        counted in the pod's memory by default)."""
        assert self._criu is not None and self.child is not None
        started = time.monotonic()
        image_dir: str | None = None
        entry: str | None = None
        handed = False
        gpu_stall_s = gpu_checkpoint_s = gpu_lock_s = 0.0
        try:
            tree = workload.process_tree(self.child)
            tracked, gpu = self._check_dumpable(tree)
            if gpu and leave_running and self._gpu_use is not None:
                gpu_budget.check_periodic(self._gpu_use.total, self.cost.history,
                                          grace_s=self.settings.grace_s)
            runtime = self._runtime_base + (time.monotonic() - self._runtime_since)
            if self._spool is not None:
                entry = self._spool.spool.new_entry(self._attempt.epoch)
                image_dir = self._spool.spool.images_dir(entry)
            else:
                image_dir = self._dump_dir(tree, gpu)
            if gpu:
                api = self._cuda_api()
                assert api is not None
                # The lock waits at most a share of the time left (the final dump's budget).
                lock_ms = cuda_mod.lock_timeout_ms(started + timeout - time.monotonic())
                stall = cuda_mod.GpuStall()
                with cuda_mod.suspended(api, gpu, resume=leave_running, lock_timeout_ms=lock_ms,
                                        stall=stall):
                    criu_mod.dump(self._criu, self.child, image_dir,
                                  leave_running=leave_running,
                                  ghost_limit=self.settings.ghost_limit,
                                  timeout=max(1.0, started + timeout - time.monotonic()))
                gpu_stall_s, gpu_checkpoint_s = stall.total_s, stall.checkpoint_s
                gpu_lock_s = stall.lock_s
            else:
                criu_mod.dump(self._criu, self.child, image_dir, leave_running=leave_running,
                              ghost_limit=self.settings.ghost_limit, timeout=timeout)
            dumped = time.monotonic()
            staged = snap_mod.directory_bytes(image_dir)
            self.cost.peak_staging_bytes = max(self.cost.peak_staging_bytes, staged)
            compat = (compat_mod.with_gpu_use(self._compat, self._gpu_use.per_gpu)
                      if gpu and self._gpu_use else self._compat)
            gpu_figures = {"gpu_stall_ms": round(gpu_stall_s * 1000, 1),
                           "gpu_checkpoint_s": round(gpu_checkpoint_s, 4),
                           "gpu_lock_s": round(gpu_lock_s, 4),
                           "gpu_bytes": self._gpu_use.total if gpu and self._gpu_use else 0}
            info = {"root_pid": self.child, "pids": tree, "gpu_pids": gpu,
                    "leave_running": leave_running, "runtime_s": round(runtime, 3)}
            if self._spool is not None and entry is not None:
                frozen_us = read_dump_stats(image_dir).frozen_us
                self._spool.spool.hand_off(
                    entry, key=self.key, store=self._store.url, epoch=self._attempt.epoch,
                    last_seq=self._attempt.log.last_seq, parent_seq=self._last_committed_seq(),
                    compat=compat, info=info, tracked_paths=tracked,
                    roots=self._track_roots)
                handed = True
                return self._spooled(entry, started, dumped, staged, frozen_us, gpu_figures)
            report = snap_mod.ingest(self._attempt, image_dir, tracked_paths=tracked,
                                     roots=self._track_roots,
                                     compat=compat, info=info)
        except Fenced:
            raise
        except (CairnError, OSError) as e:
            self.cost.failures += 1
            state = "keeps running" if leave_running else "was not stopped by a dump"
            log.error("snapshot failed (the workload %s): %s", state, e)
            self._report(failures=self._status.failures + 1, last_error=str(e)[:500],
                         last_error_at=time.time())
            return None
        finally:
            if entry is None and image_dir is not None:
                shutil.rmtree(image_dir, ignore_errors=True)
            elif not handed and self._spool is not None:
                self._spool.spool.remove(entry)
        done = time.monotonic()
        self.cost.seconds = done - started
        figures = {"seq": report.manifest.seq, "frozen_ms": report.frozen_us / 1000,
                   **gpu_figures,
                   "dump_s": round(dumped - started, 3), "ingest_s": round(done - dumped, 3),
                   "image_bytes": report.image_bytes, "bytes_written": report.bytes_written,
                   "staging_bytes": staged,
                   "staging": self._staging_medium.value if self._staging_medium else None}
        self.cost.history.append(figures)
        st = self._status
        self._report(snapshots=st.snapshots + 1, frozen_seconds=st.frozen_seconds +
                     report.frozen_us / 1e6, gpu_stall_seconds=st.gpu_stall_seconds + gpu_stall_s,
                     stall_seconds=st.stall_seconds + dumped - started,
                     bytes_written=st.bytes_written + report.bytes_written,
                     last_seq=report.manifest.seq, last_success_at=time.time())
        log.warning("snapshot seq %d committed: frozen %.0f ms (CRIU)%s, image %.1f MB, written "
                    "%.1f MB (%.0f%%), staging %.1f MB in %s, dump %.2fs + ingest %.2fs",
                    report.manifest.seq, report.frozen_us / 1000, _gpu_text(gpu_figures),
                    report.image_bytes / 1e6,
                    report.bytes_written / 1e6,
                    100 * report.bytes_written / max(report.image_bytes, 1), staged / 1e6,
                    figures["staging"], dumped - started, done - dumped)
        return _Saved(seq=report.manifest.seq)

    def _spooled(self, entry: str, started: float, dumped: float, staged: int,
                 frozen_us: int, gpu_figures: dict[str, float]) -> _Saved:
        """Account for a dump handed to the uploader. Its cost — what a final snapshot's
        budget must cover — is the dump and the hand-off, not the upload."""
        done = time.monotonic()
        self.cost.seconds = done - started
        self.cost.history.append({"entry": entry, "seq": None, "frozen_ms": frozen_us / 1000,
                                  **gpu_figures,
                                  "dump_s": round(dumped - started, 3),
                                  "handoff_s": round(done - dumped, 3), "image_bytes": staged,
                                  "bytes_written": 0, "staging_bytes": staged})
        st = self._status
        gpu_stall_s = gpu_figures["gpu_stall_ms"] / 1000
        self._report(spooled=st.spooled + 1, frozen_seconds=st.frozen_seconds + frozen_us / 1e6,
                     gpu_stall_seconds=st.gpu_stall_seconds + gpu_stall_s,
                     stall_seconds=st.stall_seconds + dumped - started)
        log.warning("snapshot spooled as entry %s: frozen %.0f ms (CRIU)%s, image %.1f MB, dump "
                    "%.2fs + hand-off %.2fs; the sidecar uploads it", entry, frozen_us / 1000,
                    _gpu_text(gpu_figures),
                    staged / 1e6, dumped - started, done - dumped)
        return _Saved(entry=entry)

    # -- the spool (cairn run --spool): the sidecar uploads --------------------------------

    def _poll_spool(self) -> None:
        if self._spool is not None:
            self._spool.poll()

    def _account_upload(self, result: spool_mod.Result) -> None:
        """Count the uploader's verdict on one of this run's entries (a fence is acted on in
        the loop)."""
        outcome = result.outcome
        if outcome is spool_mod.UploadOutcome.COMMITTED and result.seq is not None:
            for figures in self.cost.history:
                if figures.get("entry") == result.entry:
                    figures.update(seq=result.seq, bytes_written=result.bytes_written,
                                   upload_s=result.upload_s)
            st = self._status
            self._report(snapshots=st.snapshots + 1,
                         bytes_written=st.bytes_written + result.bytes_written,
                         last_seq=max(result.seq, st.last_seq or 0),
                         last_success_at=time.time())
            log.warning("snapshot seq %d committed by the sidecar (entry %s): wrote %.1f MB "
                        "of %.1f MB in %.2fs", result.seq, result.entry,
                        result.bytes_written / 1e6, result.image_bytes / 1e6, result.upload_s)
        elif outcome is spool_mod.UploadOutcome.INVALID:
            self.cost.failures += 1
            self._report(failures=self._status.failures + 1,
                         last_error=f"entry {result.entry}: {result.detail}"[:500],
                         last_error_at=time.time())
            log.error("the sidecar dropped entry %s: %s", result.entry, result.detail)
        elif outcome is not spool_mod.UploadOutcome.FENCED:
            log.info("entry %s: %s (%s)", result.entry, outcome.value, result.detail)

    def _spool_busy(self) -> bool:
        if self._spool is None:
            return False
        return self._spool.busy(on_stalled=lambda why: self._report(
            last_error=why, last_error_at=time.time()))

    def _last_committed_seq(self) -> int | None:
        """The newest snapshot this attempt restored or knows committed."""
        parent = self._attempt.parent.seq if self._attempt.parent is not None else None
        known = [seq for seq in (parent, self._status.last_seq) if seq is not None]
        return max(known) if known else None

    def _finish_attempt(self) -> None:
        """Mark the key done. With a spool, the uploader may have committed records of this
        attempt the supervisor has not seen: catch up first, and if an upload that was in
        flight takes the seq meanwhile, adopt it and try again. A ``done`` always ends the
        log: the uploader refuses to commit after its attempt's ``done``."""
        attempt = self._attempt
        if self._spool is None:
            attempt.finish()
            return
        for _ in range(8):
            attempt.log.catch_up()
            try:
                attempt.finish()
                self._attempt = attempt
                return
            except Fenced:
                try:
                    taken = self._store.log(self.key).read(attempt.log.next_seq)
                except (NotFound, CorruptSnapshot):
                    raise Fenced(f"key {self.key}: epoch {attempt.epoch} is fenced") from None
                if taken.epoch != attempt.epoch:
                    raise
                attempt = self._store.resume_attempt(self.key, epoch=attempt.epoch,
                                                     last_seq=attempt.log.last_seq,
                                                     parent_seq=None)
        raise StoreError(f"key {self.key}: the uploader kept committing while the step was "
                         "being marked done")

    def _summarize(self) -> None:
        history = self.cost.history
        if not history and not self.cost.failures:
            return
        frozen = sorted(h["frozen_ms"] for h in history)
        written = sum(h["bytes_written"] for h in history)
        image = sum(h["image_bytes"] for h in history)
        spooled = [h for h in history if h.get("entry")]
        by_sidecar = ""
        if spooled:
            committed = sum(1 for h in spooled if h.get("seq") is not None)
            by_sidecar = (f" ({len(spooled)} spooled, {committed} of them committed by the "
                          "sidecar so far)")
        log.warning("%d snapshots%s (%d failed): frozen median %.0f ms, max %.0f ms; wrote %.1f "
                    "MB for %.1f MB of images (%.0f%%); peak staging %.1f MB", len(history),
                    by_sidecar, self.cost.failures, frozen[len(frozen) // 2] if frozen else 0,
                    frozen[-1] if frozen else 0, written / 1e6, image / 1e6,
                    100 * written / max(image, 1), self.cost.peak_staging_bytes / 1e6)

    # -- endings --------------------------------------------------------------------------

    def _reap(self) -> int | None:
        """Reap exited children (adopted orphans too); the workload's status once it ended."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == 0:
                return None
            if pid == self.child:
                self.child = None
                if self._proc is not None and self._proc.pid == pid:
                    self._proc.returncode = from_wait_status(status)
                return status

    def _stopped_with_the_run(self, status: int) -> bool:
        """Whether the workload ended of the stop this run was told of rather than of its own
        failure: it ended unsuccessfully once this run had a stop signal, or it died of SIGTERM
        or SIGINT and this run's own signal came within :data:`STOP_SIGNAL_WAIT_S` (the
        platform signals every process of the step, in no set order)."""
        if from_wait_status(status) == 0:
            return False
        if self._signal is None and os.WIFSIGNALED(status) and \
                os.WTERMSIG(status) in STOP_SIGNALS:
            deadline = time.monotonic() + STOP_SIGNAL_WAIT_S
            while self._signal is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the signal handler runs in between
        return self._signal is not None

    def _workload_stopped_too(self, status: int) -> int:
        """The try ends preempted with the last snapshot kept: nothing is left to dump."""
        assert self._signal is not None
        kept = self._last_committed_seq()
        log.error("%s: the workload ended with %d, signalled with this run: no final snapshot; "
                  "%s", signal.Signals(self._signal).name, from_wait_status(status),
                  f"snapshot seq {kept} kept" if kept is not None else "no snapshot to keep")
        return ExitCode.PREEMPTED_KEPT

    def _workload_ended(self, status: int) -> int:
        code = from_wait_status(status)
        if code != 0:
            log.warning("the workload exited with %d; snapshots kept", code)
            return code
        if self.settings.on_success is OnSuccess.DROP:
            try:
                if self._spool is not None:
                    self._spool.withdraw_pending()
                self._finish_attempt()
                log.warning("the workload succeeded; key %s marked done, snapshots dropped",
                            self.key)
            except Fenced as e:
                log.error("the workload succeeded but %s", e)
            except StoreError as e:
                log.error("the workload succeeded but marking the key done failed: %s", e)
        return 0

    def _take_notice(self) -> bool:
        """Whether a sidecar's notice arrived (it is then taken, and reported)."""
        path = self.settings.notice_file
        if path is None or self._notice is not None:
            return False
        try:
            notice = channel.take_notice(path)
        except (CairnError, OSError) as e:
            log.error("ignoring an unreadable notice: %s", e)
            return False
        if notice is None:
            return False
        self._notice = notice
        counts = dict(self._status.notices)
        counts[notice.source] = counts.get(notice.source, 0) + 1
        self._report(notices=counts)
        return True

    def _report(self, **changes: Any) -> None:
        """Update the counters and, with ``status_file``, publish them (best effort)."""
        self._status = dataclasses.replace(self._status, updated_at=time.time(), **changes)
        path = self.settings.status_file
        if path is None:
            return
        try:
            channel.write_status(path, self._status)
        except OSError as e:
            if not self._status_failed:
                log.warning("cannot write the status file %s: %s", path, e)
            self._status_failed = True

    def _preempted(self) -> int:
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            started = self._signal_at
        else:
            name, started = "notice", time.monotonic()
        deadline = None
        if self._notice is not None:
            notice = self._notice
            name = f"{name} ({notice.source}: {notice.reason})" if self._signal else \
                f"notice from {notice.source} ({notice.reason})"
            deadline = notice.deadline
        remaining = FinalBudget(self.settings.grace_s, started, deadline).remaining()
        if self.cost.seconds is not None:
            estimate, basis = self.cost.seconds, "the last snapshot took"
        else:
            tree = workload.process_tree(self.child) if self.child else []
            resident = workload.resident_bytes(tree)
            estimate = estimate_unmeasured(resident)
            basis = (f"no snapshot measured yet; {resident / 1e6:.0f} MB resident at "
                     f"{UNMEASURED_BYTES_PER_S / 1e6:.0f} MB/s is about")
            gpu_bytes = gpus_mod.inventory().use_of(tree).total if workload.gpu_pids(tree) else 0
            if gpu_bytes:  # the driver's device-to-host copy comes on top
                copy = gpu_budget.estimate(gpu_bytes, self.cost.history)
                basis = (f"{basis} {estimate:.1f}s, plus the GPU copy of "
                         f"{copy.describe(gpu_bytes)}: together")
                estimate += copy.seconds
        budget_end = time.monotonic() + remaining
        self._poll_spool()
        kept = self._last_committed_seq()
        kept_text = f"snapshot seq {kept} kept" if kept is not None else "no snapshot to keep"
        if self._pages_outstanding():
            log.error("%s: no final snapshot: the lazy restore of seq %s is still filling the "
                      "workload's memory; %s", name, self.restored_from, kept_text)
            return ExitCode.PREEMPTED_KEPT
        if estimate > remaining:
            log.error("%s: no final snapshot: %s %.1fs and %.1fs of the budget are left (grace "
                      "%.0fs); %s", name, basis, estimate, remaining, self.settings.grace_s,
                      kept_text)
            return ExitCode.PREEMPTED_KEPT
        if self._spool is not None:
            self._spool.make_room(self.cost.peak_staging_bytes)
        try:
            # A dump still running when the budget ends is killed: the platform's SIGKILL is
            # due then anyway, and this way the exit says that the previous snapshot is kept.
            saved = self._snapshot(leave_running=False, timeout=max(
                budget_end - time.monotonic(), FINAL_DUMP_MIN_TIMEOUT_S))
        except Fenced as e:
            log.error("%s: %s", name, e)
            return ExitCode.FENCED
        if saved is None:
            log.error("%s: the final snapshot failed; %s", name, kept_text)
            return ExitCode.PREEMPTED_KEPT
        if saved.entry is not None:
            result = self._final_upload(saved.entry, budget_end, name)
            if result is not None and result.outcome is spool_mod.UploadOutcome.FENCED:
                return ExitCode.FENCED
            if result is not None and result.outcome is spool_mod.UploadOutcome.COMMITTED:
                log.warning("%s: final snapshot seq %d committed (uploaded by the sidecar); "
                            "exiting %d so the orchestrator retries and resumes", name,
                            result.seq, ExitCode.PREEMPTED_SAVED)
            else:
                log.warning("%s: final snapshot spooled as entry %s and still uploading when "
                            "the budget ran out (the sidecar carries on; until it commits, %s); "
                            "exiting %d", name, saved.entry, kept_text, ExitCode.PREEMPTED_SAVED)
            return ExitCode.PREEMPTED_SAVED
        log.warning("%s: final snapshot seq %d committed; exiting %d so the orchestrator "
                    "retries and resumes", name, saved.seq, ExitCode.PREEMPTED_SAVED)
        return ExitCode.PREEMPTED_SAVED

    def _ask_cause(self) -> float | None:
        """On SIGTERM in a pod whose sidecar can tell (``cause.json``), ask it why the pod is
        stopping before the final dump, so the answer is there after it (ADR 0028)."""
        if self._signal is None or self.settings.notice_file is None:
            return None
        return channel.ask_cause(os.path.dirname(os.path.abspath(self.settings.notice_file)),
                                 signal_name=signal.Signals(self._signal).name)

    def _classify(self, code: int, asked_at: float | None) -> int:
        """A preemption whose pod's Job was suspended (a Kueue eviction) ends ``suspended``
        (77; :func:`cairn.runtime.session.after_cause`): the final snapshot was taken as for a
        preemption, and the resume policy counts neither as a failure."""
        end = session.end_of_exit(code)
        if asked_at is None or end.ending is not session.Ending.PREEMPTED:
            return code
        assert self.settings.notice_file is not None
        # Never past the grace: a SIGKILL before the exit would leave no outcome at all.
        left = FinalBudget(self.settings.grace_s, self._signal_at).remaining()
        wait_s = channel.cause_wait_s(left)
        self._cause = channel.await_cause(
            os.path.dirname(os.path.abspath(self.settings.notice_file)), asked_at,
            timeout_s=wait_s)
        if self._cause is None:
            log.warning("the sidecar did not say why the pod is stopping within %.1fs; exiting "
                        "%d (preempted)", wait_s, code)
            return code
        after = session.after_cause(end, self._cause)
        classified = session.conclude(after).exit_code
        assert classified is not None
        if after.ending is not session.Ending.SUSPENDED:
            log.warning("%s; exiting %d (preempted)", self._cause.reason, code)
            return code
        log.warning("%s: exiting %d (suspended, %s), not %d; it resumes when the Job is "
                    "readmitted", self._cause.reason, classified,
                    "final snapshot taken" if end.saved else "the previous snapshot kept", code)
        return classified

    def _final_upload(self, entry: str, budget_end: float, name: str) -> spool_mod.Result | None:
        """The budget covered the final dump ``entry``; the upload goes on in the sidecar,
        which outlives this container. Wait for it while the budget lasts, to report how it
        ended (None: still uploading); a fence is logged."""
        assert self._spool is not None
        result = self._spool.await_upload(entry, budget_end - SPOOL_EXIT_MARGIN_S)
        if result is not None and result.outcome is spool_mod.UploadOutcome.FENCED:
            log.error("%s: the final snapshot cannot be committed: %s", name, result.detail)
        return result

    def _suspended(self) -> int | None:
        """Honour the suspend request: a final dump that stops the workload, bounded by the
        grace; the exit code (77, or 5 when fenced), or None when it must wait (a lazy restore
        still filling memory) or the dump failed with the workload still running: the loop
        goes on and asks again at the next poll. A dump that stopped the workload but could
        not be stored still ends the try suspended (logged), from the last committed one."""
        assert self._suspend is not None and self._suspend.request is not None
        request = self._suspend.request
        asked = f"suspend requested {suspend_mod.describe(request)}"
        if self._pages_outstanding():
            return None  # a half-filled process is not a snapshot; the pages arrive soon
        if self._spool is not None:
            self._spool.make_room(self.cost.peak_staging_bytes)
        budget_end = time.monotonic() + self.settings.grace_s
        try:
            saved = self._snapshot(leave_running=False, timeout=max(
                self.settings.grace_s, FINAL_DUMP_MIN_TIMEOUT_S))
        except Fenced as e:
            log.error("%s: %s", asked, e)
            return ExitCode.FENCED
        if saved is None:
            if self._reap() is None:  # the dump failed and CRIU let the workload go on
                self._suspend.again_later()
                log.error("%s: the final snapshot failed; the workload keeps running and the "
                          "request is tried again at the next poll", asked)
                return None
            # The dump stopped the workload, then storing it failed: still a suspension (the
            # operator's doing, not the step's), resumed from the last committed snapshot.
            kept = self._last_committed_seq()
            log.error("%s: the workload was stopped but its final snapshot failed; exiting %d, "
                      "a resume restarts from %s", asked, ExitCode.SUSPENDED,
                      f"snapshot seq {kept}" if kept is not None else "the start")
            self._suspend_detail = {**suspend_mod.detail(request), "final_snapshot": "failed"}
            return ExitCode.SUSPENDED
        if saved.entry is not None:
            result = self._final_upload(saved.entry, budget_end, asked)
            if result is not None and result.outcome is spool_mod.UploadOutcome.FENCED:
                return ExitCode.FENCED
            seq = result.seq if result is not None else None
        else:
            seq = saved.seq
        self._suspend_detail = suspend_mod.detail(request)
        log.warning("%s; exiting %d (%.2fs after the request)", suspend_mod.honoured(
            request, seq=seq, what="the workload as it was stopped"
            if seq is not None else f"spooled entry {saved.entry}, still uploading"),
            ExitCode.SUSPENDED, suspend_mod.latency_s(request))
        return ExitCode.SUSPENDED

    def _record_outcome(self, code: int | None) -> None:
        """Leave this try's outcome record for the next try and the UI (best effort; see
        :mod:`cairn.runtime.endings`). ``code`` None: the supervisor itself failed."""
        detail: dict[str, Any] = {"snapshots": len(self.cost.history),
                                  "failed_snapshots": self.cost.failures,
                                  "runtime_s": round(self._runtime_base + time.monotonic()
                                                     - self._runtime_since, 3)}
        if self._signal is not None:
            detail["signal"] = signal.Signals(self._signal).name
        if self._notice is not None:
            detail["notice"] = {"source": self._notice.source, "reason": self._notice.reason}
        if self.restored_from is not None:
            detail["resumed_from_seq"] = self.restored_from
        if self._spool is not None:
            detail["spooled"] = self._status.spooled
        if self._suspend_detail:
            detail["suspend"] = self._suspend_detail
        if self._cause is not None:
            detail["cause"] = {"suspended": self._cause.suspended, "reason": self._cause.reason}
        record_exit(self._store, self.key, epoch=self._attempt.epoch,
                    code=None if code is None else int(code), started_at=self._status.started_at,
                    maintenance=self._notice is not None and "maintenance" in self._notice.source,
                    snapshot_seq=self._last_committed_seq(), snapshot_cost_s=self.cost.seconds,
                    frozen_s=round(self._status.frozen_seconds, 4) if self.cost.history else None,
                    gpu_stall_s=round(self._status.gpu_stall_seconds, 4)
                    if self.cost.history else None,
                    stall_s=self._status.stall_seconds, bytes_written=self._status.bytes_written,
                    detail=detail)

    def _kill_child(self) -> None:
        """SIGKILL the workload's tree and reap it."""
        child = self.child
        if child is None:
            return
        for pid in reversed(workload.process_tree(child)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(child, 0)
        except ChildProcessError:
            pass
        self.child = None


def run(settings: RunSettings) -> int:
    """Run ``settings.argv`` under a supervisor; returns the exit code (module docstring)."""
    return Supervisor(settings).run()


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``[options..., "--", command...]``."""
    if "--" not in argv:
        return list(argv), []
    i = list(argv).index("--")
    return list(argv[:i]), list(argv[i + 1:])
