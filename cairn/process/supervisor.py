"""``cairn run``: run an unmodified command, snapshot it with CRIU, resume it after a kill.

The supervisor is the command's parent for its whole life, and drives the try's session
(:mod:`cairn.runtime.try_session`) through it:

* at start it opens an attempt on KEY (fencing any older one) and restores the newest
  committed snapshot whose compatibility record matches this host and workload, or starts the
  command fresh, saying which and why (:mod:`cairn.process.restorer`);
* the workload's stdout and stderr go to supervisor-owned log files (echoed to the
  supervisor's own stdout/stderr), stored with each snapshot and cut back to their dumped size
  before a restore;
* every ``every`` seconds it dumps the workload with CRIU and ingests the images into the
  store, or hands them to the sidecar's uploader through a spool (:mod:`cairn.process.dumper`);
* the workload never outlives the supervisor (:mod:`cairn.process.child`);
* SIGTERM/SIGINT, or a notice file written by the Kubernetes sidecar (``notice_file``, see
  :mod:`cairn.runtime.channel`): a final dump (which stops the workload) only if the last measured
  snapshot cost fits the budget — what is left of the grace, and of the notice's deadline; the
  exit code says whether it was committed;
* a suspend request for its try (``cairn suspend``; polled every ``suspend_poll_s``, see
  :mod:`cairn.runtime.suspend`): a final dump that stops the workload, within the grace, then
  exit ``suspended``; a failed dump leaves the workload running and is tried again at the
  next poll. While the key is held suspended a new run stops before it starts;
* with ``status_file`` it reports its counters there after each snapshot (the sidecar serves
  them as metrics);
* when the command succeeds the key is marked done and its snapshots dropped (spooled entries
  not yet uploaded are cancelled first: they would be dropped anyway).

It exits with the workload's own code when the workload ends by itself, else with the code
its session concludes (:mod:`cairn.runtime.exits` lists them all).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cairn.exceptions import (
    CairnError,
    ConfigError,
    CorruptSnapshot,
    Fenced,
    NotFound,
    RestoreFailed,
    RollbackRefused,
    StoreError,
)
from cairn.process import criu as criu_mod
from cairn.process import compat as compat_mod
from cairn.process import gpu_budget
from cairn.process import gpus as gpus_mod
from cairn.process import host_start
from cairn.process import restore as restore_mod
from cairn.process import spool as spool_mod
from cairn.process import workload
from cairn.process.child import PR_SET_CHILD_SUBREAPER, Child, StopSignals, prctl
from cairn.process.dumper import Dumper
from cairn.process.log_echo import LogEcho
from cairn.process.restorer import Restorer
from cairn.process.run_context import RunContext
from cairn.process.run_settings import DEFAULT_WORKDIR, OnSuccess, RunSettings
from cairn.process.spool_client import SpoolClient
from cairn.runtime import channel, env, rollback
from cairn.runtime import suspend as suspend_mod
from cairn.runtime.budget import UNMEASURED_BYTES_PER_S, FinalBudget, estimate_unmeasured
from cairn.runtime.endings import record_exit
from cairn.runtime.exits import ExitCode, from_wait_status
from cairn.runtime.session import Ending, TryEnd, end_of_exit
from cairn.runtime.stores import open_store
from cairn.runtime.try_session import (
    CauseWatch,
    Cost,
    FinalVerdict,
    Saved,
    TrySession,
)
from cairn.store import Store, store_kind

__all__ = ["DEFAULT_WORKDIR", "OnSuccess", "RunSettings", "Supervisor", "run",
           "split_command", "unauthenticated_root_restore"]

log = logging.getLogger("cairn.run")

FINAL_DUMP_MIN_TIMEOUT_S = 1.0  # a final dump runs until the budget ends, but at least this
SPOOL_EXIT_MARGIN_S = 0.5  # a final upload is awaited until this long before the budget ends


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


def _took_against_expected(took_s: float | None, cost: Cost | None) -> str:
    """What the final snapshot took beside what the budget expected (users size the grace
    by it; the final-snapshot bench reads it)."""
    took = "?" if took_s is None else f"{took_s:.2f}s"
    if cost is None:
        return took
    return f"{took} (expected {cost.seconds:.2f}s: {cost.basis})"


class ProcessSnapshotter:
    """Process mode's side of the try session (:class:`cairn.runtime.try_session.Snapshotter`):
    a CRIU dump of the workload."""

    def __init__(self, ctx: RunContext, child: Child, dumper: Dumper,
                 restorer: Restorer) -> None:
        self.ctx, self.child, self.dumper, self.restorer = ctx, child, dumper, restorer

    def cost(self) -> Cost:
        """The last snapshot's cost; before any, the workload's resident memory at a
        conservative rate, plus the driver's copy of its GPU memory."""
        if self.ctx.cost.seconds is not None:
            return Cost(self.ctx.cost.seconds, "the last snapshot took")
        tree = workload.process_tree(self.child.pid) if self.child.pid else []
        resident = workload.resident_bytes(tree)
        rate = self.restorer.restored_rate
        if rate is not None:
            # The snapshot this try restored, taken by the try before on (most likely) the
            # same kind of node: closer than a fixed conservative rate.
            estimate = resident / rate
            basis = (f"no snapshot measured in this try; {resident / 1e6:.0f} MB resident at "
                     f"the {rate / 1e6:.0f} MB/s the restored seq "
                     f"{self.restorer.restored_from} took is about")
        else:
            estimate = estimate_unmeasured(resident)
            basis = (f"no snapshot measured yet; {resident / 1e6:.0f} MB resident at "
                     f"{UNMEASURED_BYTES_PER_S / 1e6:.0f} MB/s is about")
        gpu_bytes = gpus_mod.inventory().use_of(tree).total if workload.gpu_pids(tree) else 0
        if gpu_bytes:  # the driver's device-to-host copy comes on top
            copy = gpu_budget.estimate(gpu_bytes, self.ctx.cost.history)
            basis = (f"{basis} {estimate:.1f}s, plus the GPU copy of "
                     f"{copy.describe(gpu_bytes)}: together")
            estimate += copy.seconds
        return Cost(estimate, basis)

    def blocked(self) -> str | None:
        if self.restorer.pages_outstanding():  # a half-filled process is not a snapshot
            return (f"the lazy restore of seq {self.restorer.restored_from} is still filling "
                    "the workload's memory")
        return None

    def snapshot(self, *, final: bool, timeout_s: float | None) -> Saved | None:
        if not final:
            return self.dumper.snapshot(leave_running=True)
        if self.dumper.spool is not None:
            self.dumper.spool.make_room(self.ctx.cost.peak_staging_bytes)
        # A dump still running when the budget ends is killed: the platform's SIGKILL is due
        # then anyway, and this way the exit says that the previous snapshot is kept.
        return self.dumper.snapshot(leave_running=False, timeout=max(
            timeout_s or 0.0, FINAL_DUMP_MIN_TIMEOUT_S))

    def stopped(self) -> bool:
        return self.child.reap() is not None or self.child.pid is None


class Supervisor:
    """One ``cairn run``. Construct, then :meth:`run` (main thread only) for the exit code."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.ctx = RunContext(settings)
        self.key = self.ctx.key
        self.child = Child()
        self.signals = StopSignals()
        self.dumper = Dumper(self.ctx, self.child)
        self.restorer = Restorer(self.ctx, self.child)
        self.snapshotter = ProcessSnapshotter(self.ctx, self.child, self.dumper, self.restorer)
        self.session = TrySession(every_s=settings.every_s, notice=self._stop_asked,
                                  cause=CauseWatch.beside(settings.notice_file))
        self._echo: LogEcho | None = None
        self._notice: channel.Notice | None = None
        self._suspend: suspend_mod.SuspendWatch | None = None
        self._suspend_detail: dict[str, Any] = {}  # the request honoured, for the outcome

    # -- entry point -----------------------------------------------------------------------

    def _read_ahead(self) -> None:
        """Read and parse the key's snapshot records while the host checks run on their
        thread: reads only, and the slot log keeps what it parsed, so opening the attempt and
        choosing the snapshot parse nothing again; the newest snapshot's chunk tables are
        decoded too (together ~0.1 s for a 1 GiB image). A failure is left for those steps to
        meet and report."""
        assert self.ctx.store is not None
        with contextlib.suppress(CairnError, OSError):
            for info in self.ctx.store.snapshots(self.key):
                if info.seq not in self.settings.exclude_seqs:
                    # The chunk tables and pack extents the check and the restore read
                    # (decoded at first use and kept with the manifest).
                    info.manifest.pack_ends()
                    break

    def _close_store(self) -> None:
        if self.ctx.store is not None:
            self.ctx.store.close()
            self.ctx.store = None

    def _refusal(self) -> int | None:
        """Before the try opens: the exit code of a run that cannot start (said why), or
        None. Opens the store, runs the host checks and finds CRIU."""
        s = self.settings
        # The cursor made writable, then the host checks' thread: begun by the entry point
        # before the CLI's imports (host_start), or now; beside the store's opening.
        begun = host_start.take(preflight=s.preflight)
        if begun.cursor_note:
            log.warning("%s", begun.cursor_note)
        if begun.cursor_error is not None:
            log.warning("cannot make /proc/sys writable (%s); the workload will start at a low "
                        "PID that a restore in a fresh container may find taken",
                        begun.cursor_error)
        preflight = begun.preflight
        unopened: StoreError | None = None
        try:
            self.ctx.store = open_store(s.store)
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
            self.ctx.criu = criu_mod.find_criu()
        except ConfigError as e:
            log.error("%s", e)
            self._close_store()
            return ExitCode.NOT_READY
        if s.restore is restore_mod.RestoreMode.LAZY:
            self.restorer.probe_lazy()
        self.signals.install()
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        os.makedirs(self.ctx.run_dir, exist_ok=True)
        if s.spool_dir:
            try:
                self.dumper.spool = SpoolClient.prepare(s.spool_dir, wait_s=s.spool_wait_s,
                                                        account=self.dumper.account_upload)
            except (CairnError, OSError) as e:
                log.error("cannot use the spool %s: %s", s.spool_dir, e)
                self._close_store()
                return ExitCode.USAGE
        if unopened is not None:
            log.error("cannot open the store: %s", unopened)
            return ExitCode.STORAGE
        return None

    def _open_try(self) -> int | None:
        """Open the try's attempt (fencing older ones); the exit code of a run that must not
        (said why), or None."""
        store = self.ctx.store
        assert store is not None
        try:
            refusal = unauthenticated_root_restore(store)
            if refusal is not None:
                log.error("%s", refusal)
                store.close()
                return ExitCode.USAGE
            held = suspend_mod.held(store, self.key)
            if held is not None:  # before the attempt opens: nothing is fenced or restored
                log.error("%s", held)
                store.close()
                return ExitCode.SUSPENDED
            mark = self.ctx.mark = rollback.local_mark(store.url, str(self.key))
            floor = self.ctx.rollback_floor = rollback.oldest_allowed(
                mark, allowed=self.settings.allow_rollback, exclude=self.settings.exclude_seqs)
            attempt = self.ctx.attempt = rollback.open_attempt(
                store, self.key, mark, floor=floor, flag=rollback.ROLLBACK_FLAG,
                note={"mode": "process", "host": os.uname().nodename,
                      "argv": list(self.settings.argv)},
                exclude=self.settings.exclude_seqs)
            if self.dumper.spool is not None:
                self.dumper.spool.epoch = attempt.epoch
            self._suspend = suspend_mod.SuspendWatch(store, self.key, epoch=attempt.epoch,
                                                     interval_s=self.settings.suspend_poll_s)
        except RollbackRefused as e:  # before the attempt opens: nothing fenced or restored
            log.error("%s (exit %d)", e, ExitCode.ROLLBACK_REFUSED)
            store.close()
            return ExitCode.ROLLBACK_REFUSED
        except StoreError as e:
            log.error("cannot open the store: %s", e)
            return ExitCode.STORAGE
        self.session.opened(attempt.epoch)
        self.session.set_watchers(suspend=self._suspend.poll)
        return None

    def run(self) -> int:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("Supervisor.run() must be called from the main thread")
        refused = self._refusal()
        if refused is None:
            refused = self._open_try()
        if refused is not None:
            self.signals.close()
            return refused
        self.ctx.compat = compat_mod.current_record(self.settings.argv, cwd=self.ctx.cwd,
                                                    criu=self.ctx.criu)
        end = TryEnd(ending=Ending.FAILED)  # the supervisor itself failed
        try:
            end = self._supervise()
        except RestoreFailed as e:  # nothing was skipped: the snapshots stay for the retry
            end = TryEnd(ending=Ending.RESTORE_FAILED)
            log.error("%s (exit %d)", e, ExitCode.RESTORE_FAILED, exc_info=e.__cause__ or e)
        except RollbackRefused as e:  # the newer snapshots failed their checks (ADR 0049)
            end = TryEnd(ending=Ending.FAILED, code=ExitCode.ROLLBACK_REFUSED)
            log.error("%s (exit %d)", e, ExitCode.ROLLBACK_REFUSED)
        finally:
            conclusion = self.session.end(end)
            self._stop_echo()
            self.dumper.poll_spool()
            self.dumper.summarize()
            self.child.kill()
            self.restorer.close()
            shutil.rmtree(self.ctx.staging, ignore_errors=True)
            self.ctx.release_memory_staging()
            self._record_outcome()
            assert self.ctx.store is not None
            self.ctx.store.close()
            self.signals.close()
        code = conclusion.exit_code
        assert code is not None
        return int(code)

    def _start_echo(self, offsets: dict[str, int]) -> None:
        if self.settings.echo:
            self._echo = LogEcho([(self.ctx.stdout_path, sys.stdout.buffer),
                                  (self.ctx.stderr_path, sys.stderr.buffer)])
            self._echo.start_at(offsets)

    def _stop_echo(self) -> None:
        if self._echo is not None:
            self._echo.stop()
            self._echo = None

    def _supervise(self) -> TryEnd:
        offsets = self.restorer.start()
        self.session.started(restored_from=self.restorer.restored_from)
        self.ctx.runtime_since = time.monotonic()
        if self.restorer.restored_from is not None:
            self.ctx.board.report(resumes=1, work_saved_seconds=self.ctx.runtime_base)
        else:
            self.ctx.board.report()
        self._start_echo(offsets)
        while True:
            status = self.child.reap()
            if self.restorer.lazy_failed():
                self._stop_echo()
                self._start_echo(self.restorer.restart_after_lazy_failure())
                continue
            if status is not None:
                if self.signals.came_with(status):
                    self._ask_cause()
                    return self._after_cause(self._workload_stopped_too(status))
                return self._workload_ended(status)
            triggers = self.session.triggers()
            if triggers.notice:
                self._ask_cause()
                return self._after_cause(self._preempted())
            if triggers.suspend:
                end = self._suspended()
                if end is not None:
                    return end
            self.dumper.poll_spool()
            spool = self.dumper.spool
            if spool is not None and spool.fenced is not None:
                log.error("the uploader could not commit entry %s: %s; stopping the workload",
                          spool.fenced.entry, spool.fenced.detail)
                return TryEnd(ending=Ending.FENCED)
            if self.session.due():
                if self.restorer.pages_outstanding():
                    self.session.defer(1.0)  # a half-filled process is not a snapshot
                    continue
                if self.dumper.spool_busy():
                    self.session.defer(1.0)  # the previous dump is still being uploaded
                    continue
                try:
                    self.snapshotter.snapshot(final=False, timeout_s=None)
                except Fenced as e:
                    log.error("%s; stopping the workload", e)
                    return TryEnd(ending=Ending.FENCED)
                self.session.snapshot_taken()
                continue
            due_in = self.session.seconds_to_due()
            self.signals.wake.wait(1.0 if due_in is None else min(1.0, due_in))

    # -- endings --------------------------------------------------------------------------

    def _stop_asked(self) -> bool:
        """The notice watcher: a stop signal, or a sidecar's notice."""
        return self.signals.signum is not None or self._take_notice()

    def _workload_stopped_too(self, status: int) -> TryEnd:
        """The try ends preempted with the last snapshot kept: nothing is left to dump."""
        kept = self.ctx.last_committed_seq()
        log.error("%s: the workload ended with %d, signalled with this run: no final snapshot; "
                  "%s", self.signals.name, from_wait_status(status),
                  f"snapshot seq {kept} kept" if kept is not None else "no snapshot to keep")
        return TryEnd(ending=Ending.PREEMPTED, saved=False, evicted=self._maintenance())

    def _workload_ended(self, status: int) -> TryEnd:
        code = from_wait_status(status)
        if code != 0:
            log.warning("the workload exited with %d; snapshots kept", code)
            return end_of_exit(code, maintenance=self._maintenance())
        if self.settings.on_success is OnSuccess.DROP:
            try:
                if self.dumper.spool is not None:
                    self.dumper.spool.withdraw_pending()
                self._finish_attempt()
                log.warning("the workload succeeded; key %s marked done, snapshots dropped",
                            self.key)
            except Fenced as e:
                log.error("the workload succeeded but %s", e)
            except StoreError as e:
                log.error("the workload succeeded but marking the key done failed: %s", e)
        return TryEnd(ending=Ending.SUCCEEDED)

    def _finish_attempt(self) -> None:
        """Mark the key done. With a spool, the uploader may have committed records of this
        attempt the supervisor has not seen: catch up first, and if an upload that was in
        flight takes the seq meanwhile, adopt it and try again. A ``done`` always ends the
        log: the uploader refuses to commit after its attempt's ``done``."""
        attempt, store = self.ctx.attempt, self.ctx.store
        assert store is not None
        if self.dumper.spool is None:
            attempt.finish()
            return
        for _ in range(8):
            attempt.log.catch_up()
            try:
                attempt.finish()
                self.ctx.attempt = attempt
                return
            except Fenced:
                try:
                    taken = store.log(self.key).read(attempt.log.next_seq)
                except (NotFound, CorruptSnapshot):
                    raise Fenced(f"key {self.key}: epoch {attempt.epoch} is fenced") from None
                if taken.epoch != attempt.epoch:
                    raise
                attempt = store.resume_attempt(self.key, epoch=attempt.epoch,
                                               last_seq=attempt.log.last_seq, parent_seq=None)
        raise StoreError(f"key {self.key}: the uploader kept committing while the step was "
                         "being marked done")

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
        counts = dict(self.ctx.status.notices)
        counts[notice.source] = counts.get(notice.source, 0) + 1
        self.ctx.board.report(notices=counts)
        return True

    def _maintenance(self) -> bool:
        """Whether the stop was announced as maintenance (an eviction, not a preemption)."""
        return self._notice is not None and "maintenance" in self._notice.source

    def _preempted(self) -> TryEnd:
        """A stop signal or a notice: the final snapshot when its cost fits the budget."""
        if self.signals.signum is not None:
            name, started = self.signals.name, self.signals.at
        else:
            name, started = "notice", time.monotonic()
        deadline = None
        if self._notice is not None:
            notice = self._notice
            name = f"{name} ({notice.source}: {notice.reason})" if self.signals.signum else \
                f"notice from {notice.source} ({notice.reason})"
            deadline = notice.deadline
        remaining = FinalBudget(self.settings.grace_s, started, deadline).remaining()
        budget_end = time.monotonic() + remaining
        self.dumper.poll_spool()
        kept = self.ctx.last_committed_seq()
        kept_text = f"snapshot seq {kept} kept" if kept is not None else "no snapshot to keep"
        kept_end = TryEnd(ending=Ending.PREEMPTED, saved=False, evicted=self._maintenance())
        try:
            final = self.session.final_snapshot(self.snapshotter, remaining_s=remaining)
        except Fenced as e:
            log.error("%s: %s", name, e)
            return TryEnd(ending=Ending.FENCED)
        if final.verdict is FinalVerdict.BLOCKED:
            log.error("%s: no final snapshot: %s; %s", name, final.blocked, kept_text)
            return kept_end
        if final.verdict is FinalVerdict.OVER_BUDGET:
            assert final.cost is not None
            log.error("%s: no final snapshot: %s %.1fs and %.1fs of the budget are left (grace "
                      "%.0fs); %s", name, final.cost.basis, final.cost.seconds, remaining,
                      self.settings.grace_s, kept_text)
            return kept_end
        if final.saved is None:
            log.error("%s: the final snapshot failed; %s", name, kept_text)
            return kept_end
        saved_end = TryEnd(ending=Ending.PREEMPTED, saved=True, evicted=self._maintenance())
        code = ExitCode.PREEMPTED_SAVED
        if final.saved.entry is not None:
            result = self._final_upload(final.saved.entry, budget_end, name)
            if result is not None and result.outcome is spool_mod.UploadOutcome.FENCED:
                return TryEnd(ending=Ending.FENCED)
            if result is not None and result.outcome is spool_mod.UploadOutcome.COMMITTED:
                log.warning("%s: final snapshot seq %d committed (uploaded by the sidecar); "
                            "exiting %d so the orchestrator retries and resumes", name,
                            result.seq, code)
            else:
                log.warning("%s: final snapshot spooled as entry %s and still uploading when "
                            "the budget ran out (the sidecar carries on; until it commits, %s); "
                            "exiting %d", name, final.saved.entry, kept_text, code)
            return saved_end
        log.warning("%s: final snapshot seq %d committed in %s; exiting %d so the "
                    "orchestrator retries and resumes", name, final.saved.seq,
                    _took_against_expected(self.ctx.cost.seconds, final.cost), code)
        return saved_end

    def _ask_cause(self) -> None:
        """On SIGTERM in a pod whose sidecar can tell (``cause.json``), ask it why the pod is
        stopping before the final dump, so the answer is there after it (ADR 0028)."""
        if self.signals.signum is not None:
            self.session.cause.ask(signal_name=self.signals.name)

    def _after_cause(self, end: TryEnd) -> TryEnd:
        """A preemption whose pod's Job was suspended (a Kueue eviction) ends ``suspended``
        (:func:`cairn.runtime.session.after_cause`): the final snapshot was taken as for a
        preemption, and the resume policy counts neither as a failure."""
        if self.session.cause.asked_at is None or end.ending is not Ending.PREEMPTED:
            return end
        # Never past the grace: a SIGKILL before the exit would leave no outcome at all.
        left = FinalBudget(self.settings.grace_s, self.signals.at).remaining()
        after = self.session.after_cause(end, budget_left_s=left)
        cause = self.session.cause.cause
        preempted = int(ExitCode.PREEMPTED_SAVED if end.saved else ExitCode.PREEMPTED_KEPT)
        if cause is None:
            log.warning("the sidecar did not say why the pod is stopping within %.1fs; exiting "
                        "%d (preempted)", channel.cause_wait_s(left), preempted)
        elif after.ending is not Ending.SUSPENDED:
            log.warning("%s; exiting %d (preempted)", cause.reason, preempted)
        else:
            log.warning("%s: exiting %d (suspended, %s), not %d; it resumes when the Job is "
                        "readmitted", cause.reason, ExitCode.SUSPENDED,
                        "final snapshot taken" if end.saved else "the previous snapshot kept",
                        preempted)
        return after

    def _final_upload(self, entry: str, budget_end: float, name: str) -> spool_mod.Result | None:
        """The budget covered the final dump ``entry``; the upload goes on in the sidecar,
        which outlives this container. Wait for it while the budget lasts, to report how it
        ended (None: still uploading); a fence is logged."""
        assert self.dumper.spool is not None
        result = self.dumper.spool.await_upload(entry, budget_end - SPOOL_EXIT_MARGIN_S)
        if result is not None and result.outcome is spool_mod.UploadOutcome.FENCED:
            log.error("%s: the final snapshot cannot be committed: %s", name, result.detail)
        return result

    def _suspended(self) -> TryEnd | None:
        """Honour the suspend request: a final dump that stops the workload, bounded by the
        grace; the try's end (suspended, or fenced), or None when it must wait (a lazy restore
        still filling memory) or the dump failed with the workload still running: the loop
        goes on and asks again at the next poll. A dump that stopped the workload but could
        not be stored still ends the try suspended (logged), from the last committed one."""
        assert self._suspend is not None and self._suspend.request is not None
        request = self._suspend.request
        asked = f"suspend requested {suspend_mod.describe(request)}"
        budget_end = time.monotonic() + self.settings.grace_s
        try:
            final = self.session.final_snapshot(self.snapshotter, remaining_s=None,
                                                timeout_s=self.settings.grace_s)
        except Fenced as e:
            log.error("%s: %s", asked, e)
            return TryEnd(ending=Ending.FENCED)
        if final.verdict is FinalVerdict.BLOCKED:
            self.session.carry_on()  # a half-filled process is not a snapshot; pages come soon
            return None
        suspended = TryEnd(ending=Ending.SUSPENDED)
        if final.saved is None:
            if not self.snapshotter.stopped():  # the dump failed, CRIU let the workload go on
                self.session.carry_on()
                self._suspend.again_later()
                log.error("%s: the final snapshot failed; the workload keeps running and the "
                          "request is tried again at the next poll", asked)
                return None
            # The dump stopped the workload, then storing it failed: still a suspension (the
            # operator's doing, not the step's), resumed from the last committed snapshot.
            kept = self.ctx.last_committed_seq()
            log.error("%s: the workload was stopped but its final snapshot failed; exiting %d, "
                      "a resume restarts from %s", asked, ExitCode.SUSPENDED,
                      f"snapshot seq {kept}" if kept is not None else "the start")
            self._suspend_detail = {**suspend_mod.detail(request), "final_snapshot": "failed"}
            return suspended
        saved = final.saved
        if saved.entry is not None:
            result = self._final_upload(saved.entry, budget_end, asked)
            if result is not None and result.outcome is spool_mod.UploadOutcome.FENCED:
                return TryEnd(ending=Ending.FENCED)
            seq = result.seq if result is not None else None
        else:
            seq = saved.seq
        self._suspend_detail = suspend_mod.detail(request)
        log.warning("%s; exiting %d (%.2fs after the request)", suspend_mod.honoured(
            request, seq=seq, what="the workload as it was stopped"
            if seq is not None else f"spooled entry {saved.entry}, still uploading"),
            ExitCode.SUSPENDED, suspend_mod.latency_s(request))
        return TryEnd(ending=Ending.SUSPENDED, saved=True)

    def _record_outcome(self) -> None:
        """Leave this try's outcome record for the next try and the UI (best effort; see
        :mod:`cairn.runtime.endings`)."""
        ctx, status = self.ctx, self.ctx.status
        assert self.session.conclusion is not None
        detail: dict[str, Any] = {"snapshots": len(ctx.cost.history),
                                  "failed_snapshots": ctx.cost.failures,
                                  "runtime_s": round(ctx.runtime_s(), 3)}
        if self.signals.signum is not None:
            detail["signal"] = self.signals.name
        if self._notice is not None:
            detail["notice"] = {"source": self._notice.source, "reason": self._notice.reason}
        if self.restorer.restored_from is not None:
            detail["resumed_from_seq"] = self.restorer.restored_from
        if self.dumper.spool is not None:
            detail["spooled"] = status.spooled
        if self._suspend_detail:
            detail["suspend"] = self._suspend_detail
        cause = self.session.cause.cause
        if cause is not None:
            detail["cause"] = {"suspended": cause.suspended, "reason": cause.reason}
        record_exit(ctx.store, self.key, epoch=ctx.attempt.epoch,
                    conclusion=self.session.conclusion, started_at=status.started_at,
                    snapshot_seq=ctx.last_committed_seq(), snapshot_cost_s=ctx.cost.seconds,
                    frozen_s=round(status.frozen_seconds, 4) if ctx.cost.history else None,
                    gpu_stall_s=round(status.gpu_stall_seconds, 4)
                    if ctx.cost.history else None,
                    stall_s=status.stall_seconds, bytes_written=status.bytes_written,
                    detail=detail)


def run(settings: RunSettings) -> int:
    """Run ``settings.argv`` under a supervisor; returns the exit code (module docstring)."""
    return Supervisor(settings).run()


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``[options..., "--", command...]``."""
    if "--" not in argv:
        return list(argv), []
    i = list(argv).index("--")
    return list(argv[:i]), list(argv[i + 1:])
