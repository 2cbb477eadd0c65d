"""Checkpointer: the few lines a training loop adds to resume where it stopped.

::

    ckpt = Checkpointer.from_env()                    # CAIRN_STORE and CAIRN_KEY
    start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, loader=loader)
    for step in range(start, total):
        ...                                           # one step, optimizer update included
        ckpt.step(step)                               # after the update; may snapshot
    ckpt.close()

Semantics: :meth:`Checkpointer.restore` opens this attempt (fencing any older one), loads
the newest snapshot that verifies and fits, and returns the step to run next (the last
completed step + 1, or 0). :meth:`Checkpointer.step` takes a snapshot when the policy says so;
the snapshot holds the state *after* that step's update.

Stage, then persist: by default (``persist=PersistMode.PROCESS``) a snapshot copies every
tensor into a pre-faulted shared-memory staging buffer and returns; a separate writer process
(:mod:`cairn.state.writer_process`) chunks, hashes, dedups and commits it, so training stalls only
for the copy. ``close()`` waits until the last snapshot is durable and raises if it failed. If a
persist is still running at the next trigger, ``when_busy`` decides: wait for it, or skip this
snapshot. ``PersistMode.INLINE`` persists on the calling thread instead (durable when ``step``
returns). RAM: one staging buffer is 1× the state's bytes (``buffers=2``: 2×).

The copy into the staging buffer is split over ``torch.get_num_threads()`` threads.
:meth:`Checkpointer.restore` starts the writer process, and a background thread allocates and
pre-faults the first staging buffer, so that the first snapshot stalls no longer than later
ones. The buffer is sized from the snapshot restored, or else from the live state once every
optimizer has state (a fresh optimizer creates it at its first step: then the first snapshot
allocates the buffer).

A snapshot the writer fails to commit (the writer process died, the store refused a write) is
logged and the next one is tried with a new writer if needed; ``step()`` raises
:class:`~cairn.exceptions.StoreError` once ``max_failures`` snapshots in a row have failed.
Fencing raises at once.

Suspend requests (``cairn suspend``, :mod:`cairn.runtime.suspend`): ``step()`` looks for one
every ``suspend_poll_seconds`` (default ``$CAIRN_SUSPEND_POLL``, 5 s) and, at the first step
after it arrives, takes a final snapshot, records the ``suspended`` outcome and raises
:class:`~cairn.exceptions.Suspended` (a script that lets it propagate exits ``suspended``,
:mod:`cairn.runtime.exits`). So a suspend is honoured within the poll interval + one step +
the final snapshot. ``restore()`` raises it at once, opening nothing, while the key is held
suspended (no ``cairn resume`` yet).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from cairn.exceptions import (
    CairnError,
    ConfigError,
    Fenced,
    Preempted,
    PreemptedExit,
    StoreError,
    StoreUnreachable,
    StoreUnreachableExit,
    Suspended,
)
from cairn.runtime import endings, env, exits, rollback, session
from cairn.runtime import suspend as suspend_mod
from cairn.runtime.interval import observed_mtbf, young_daly_interval
from cairn.runtime.try_session import CauseWatch, Cost, FinalVerdict, Saved, TrySession
from cairn.state import capture
from cairn.state.codec import flatten, header_of, shards_in
from cairn.state.distributed import Group
from cairn.state.options import (
    LrScaling,
    PersistMode,
    SnapshotPolicy,
    WhenBusy,
    options_from_env,
)
from cairn.state.persister import Persister
from cairn.state.rank_reads import read_together, wait_for_record
from cairn.state.resize import (
    REFUSED_BY_OPTION,
    Resize,
    read_positions,
    rescale_lr,
    resize_for,
    resized,
)
from cairn.state.staging import plan
from cairn.state.state_io import load_state, save_state, staged_size
from cairn.state.status import StatusReporter
from cairn.state.triggers import (
    PreemptionNotice,
    PreemptionPolicy,
    signal_names,
)
from cairn.runtime.stores import open_store
from cairn.store import Key, Manifest, SnapshotInfo, Store

__all__ = ["Checkpointer", "PersistMode", "SnapshotPolicy", "WhenBusy", "load_state",
           "save_state"]

log = logging.getLogger(__name__)

class Checkpointer:
    """Snapshots a training loop's state into a cairn store and resumes from it.

    One thread uses a Checkpointer. Call :meth:`restore` first: it opens the attempt and names
    the objects every later snapshot captures.
    """

    def __init__(self, *, store: str | Store, key: str | Key,
                 policy: SnapshotPolicy | None = None, every_steps: int | None = None,
                 every_seconds: float | None = None,
                 preemption: PreemptionPolicy | None = PreemptionPolicy(),
                 persist: PersistMode = PersistMode.PROCESS, when_busy: WhenBusy = WhenBusy.WAIT,
                 buffers: int = 1, max_failures: int = 3,
                 exclude_seqs: Collection[int] = (), status_file: str | None = None,
                 suspend_poll_seconds: float | str | None = None,
                 allow_rollback: bool | None = None, resize: bool = True,
                 resize_lr: LrScaling = LrScaling.KEEP) -> None:
        if buffers not in (1, 2):
            raise ConfigError("buffers must be 1 (RAM 1x the state) or 2 (double buffering, 2x)")
        if not isinstance(max_failures, int) or max_failures < 1:
            raise ConfigError("max_failures must be an integer of at least 1 (1: raise at the "
                              "first snapshot that fails)")
        if policy is None:
            policy = (SnapshotPolicy(every_steps=every_steps, every_seconds=every_seconds)
                      if every_steps is not None or every_seconds is not None else SnapshotPolicy())
        if any(not isinstance(seq, int) or isinstance(seq, bool) for seq in exclude_seqs):
            raise ConfigError("exclude_seqs must be snapshot seqs (integers)")
        self.policy = policy
        # How often step() looks for a `cairn suspend` request (None: $CAIRN_SUSPEND_POLL).
        self.suspend_poll_seconds = suspend_mod.poll_seconds(suspend_poll_seconds)
        self._suspend: suspend_mod.SuspendWatch | None = None
        self._started_at = time.time()
        self.exclude_seqs = frozenset(exclude_seqs)  # never restored (a resume policy's verdict)
        # For the pod sidecar's metrics; None: $CAIRN_STATUS_FILE; "": none. Rank 0 writes it.
        self._status_file = env.STATUS_FILE.get() if status_file is None else status_file
        self._status: StatusReporter | None = None
        self._owns_store = not isinstance(store, Store)
        try:
            self.store = open_store(store) if isinstance(store, str) else store
        except StoreUnreachable as e:
            # A bare script that lets this propagate exits 6, as `cairn run` does, not 1.
            log.error("%s", e)
            raise StoreUnreachableExit(str(e), url=e.url, reason=e.reason,
                                       code=exits.ExitCode.STORAGE) from e
        self.key = Key.parse(key) if isinstance(key, str) else key
        # ADR 0049: the newest seq committed, recorded on this machine; None: $CAIRN_ALLOW_ROLLBACK
        self._mark = rollback.local_mark(self.store.url, str(self.key))
        self.allow_rollback = rollback.rollback_allowed() if allow_rollback is None \
            else allow_rollback
        self._floor: int | None = None
        self._attempt: Any = None
        self._targets: capture.Targets | None = None
        self.extras: dict[str, Any] = {}
        self.restored_from: Manifest | None = None
        self.last_snapshot: Manifest | None = None
        self._last_step: int | None = None
        self._preemption = preemption
        self._notice: PreemptionNotice | None = None
        self.session = TrySession()  # this try's phases, interval, watchers and end
        self.snapshot_cost_s: float | None = None  # moving average of stall + persist time
        self.last_stall_s: float | None = None  # time the last save() kept training waiting
        # This try's totals over its committed snapshots, for its outcome's summary.
        self.stall_total_s = 0.0
        self.bytes_written_total = 0
        self._mtbf: float | None = None
        self._mtbf_known = False  # read from the key's log on first use
        self.persist_mode = PersistMode(persist)
        self.when_busy = WhenBusy(when_busy)
        self._buffer_count = buffers
        self._persister: Persister | None = None  # None: inline
        self._fenced = False
        self._last_error: str | None = None
        self.max_failures = max_failures
        self.failures = 0  # snapshots in a row that the writer did not commit
        self.committed_seq: int | None = None
        self.outcome_recorded = False  # set once this try's outcome record is written
        self.committed_step: int | None = None
        self.skipped = 0  # snapshots skipped because the previous one was still persisting
        self._group = Group()
        # None: a snapshot of another world size resizes; else why it is refused (an
        # integration whose own state cannot follow a resize says so here).
        self.resize_refusal: str | None = None if resize else REFUSED_BY_OPTION
        self.resized: Resize | None = None  # set by restore() when it resized N -> M ranks
        self.resize_lr = LrScaling(resize_lr)  # what a resize does to the learning rates

    @classmethod
    def from_env(cls, **options: Any) -> Checkpointer:
        """From ``CAIRN_STORE`` and ``CAIRN_KEY`` (set by the Airflow operator or KFP component;
        in a SLURM job without ``CAIRN_KEY``, the job's key, :mod:`cairn.runtime.slurm`), plus
        optional ``CAIRN_EVERY_STEPS``, ``CAIRN_EVERY_SECONDS`` and ``CAIRN_EXCLUDE_SEQS``
        (comma-separated seqs never to restore)."""
        store, key, options = options_from_env(options)
        return cls(store=store, key=key, **options)

    def restore(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                scaler: Any = None, loader: Any = None, models: dict[str, Any] | None = None,
                optimizers: dict[str, Any] | None = None,
                items: Mapping[str, Any] | None = None) -> int:
        """Open the attempt, load the newest snapshot that verifies, return the next step.

        What every snapshot captures: ``items``, any number of named objects that follow
        torch's ``Stateful`` protocol (``state_dict()`` / ``load_state_dict()``), as
        ``torch.distributed.checkpoint`` takes them; ``model=``/``models=``,
        ``optimizer=``/``optimizers=``, ``scheduler=``, ``scaler=`` and ``loader=`` are
        shorthands for the common ones (the model's tensors checked against the snapshot's,
        the loader's workers' RNGs kept). A restore needs the same names as the snapshot.

        All or nothing: a snapshot that fails verification is skipped (logged) for the one
        before it; one that does not fit the live objects raises
        :class:`~cairn.state.capture.StateMismatch` before anything is loaded. A snapshot
        taken by another number of ranks resizes (DDP and FSDP2, a loader's epoch dealt;
        ``resize_lr`` its learning-rate rule; ``resize=False`` refuses it;
        :mod:`cairn.state.resize`) and sets :attr:`resized`. Reading that
        fails on this side (a library error, a bug, out of memory; on any rank) skips nothing:
        it raises :class:`~cairn.exceptions.RestoreFailedExit` (a script that lets it
        propagate exits 8), logged with its cause.
        """
        if self._attempt is not None:
            raise ConfigError("restore() was already called on this Checkpointer")
        if model is not None and models is not None or optimizer is not None and optimizers is not None:
            raise ConfigError("pass model= or models=, optimizer= or optimizers=, not both")
        self._targets = capture.Targets(
            models=capture.named(models if models is not None else model, "model"),
            optimizers=capture.named(optimizers if optimizers is not None else optimizer, "optimizer"),
            schedulers=capture.named(scheduler, "scheduler"),
            scalers=capture.named(scaler, "scaler"),
            loader=loader,
            items=capture.named(dict(items) if items is not None else None, "item"),
        )
        self._group = Group.detect()
        if self._group.active and self.persist_mode is not PersistMode.PROCESS:
            raise ConfigError("distributed training needs persist=PersistMode.PROCESS")
        # A key held suspended starts no try: nothing is opened, fenced or restored.
        held = suspend_mod.held(self.store, self.key) if self._group.rank == 0 else None
        if self._group.broadcast([int(held is not None)])[0]:
            error = held or suspend_mod.held_elsewhere(self.key)
            log.warning("%s", error)  # a script that lets it propagate exits silently
            raise error
        self._started_at = time.time()
        if self._group.rank == 0:
            self._floor = rollback.oldest_allowed(self._mark, allowed=self.allow_rollback,
                                                  exclude=self.exclude_seqs)
            with rollback.exits_when_refused(log):  # a script that lets it out exits 9
                self._attempt = rollback.open_attempt(
                    self.store, self.key, self._mark, floor=self._floor,
                    note={"mode": "state"}, exclude=self.exclude_seqs)
            epoch = self._group.broadcast([self._attempt.epoch])[0]
        else:
            epoch = self._group.broadcast([0])[0]
            self._attempt = self.store.join_attempt(self.key, epoch=epoch)
        self.session.opened(epoch)
        if self._group.rank == 0:  # the others learn of a request from rank 0 (step())
            self._suspend = suspend_mod.SuspendWatch(self.store, self.key, epoch=epoch,
                                                     interval_s=self.suspend_poll_seconds)
            self.session.set_watchers(suspend=self._suspend.poll)
        if self._preemption is not None:
            notice = self._notice = PreemptionNotice(self._preemption)
            if notice.install():
                log.info("watching %s for preemption", signal_names(self._preemption.signals))
            self.session.set_watchers(notice=lambda: notice.pending)
            if self._group.rank == 0:  # rank 0 asks for every rank: one Job is suspended whole
                self.session.cause = CauseWatch.beside(notice.notice_file)
        own = f"rank-{self._group.rank}/" if self._group.active else ""
        for info in self._candidates():
            resize = resize_for(info.manifest, self._group, self._targets,
                                refusal=self.resize_refusal)
            prefix = resize.prefix if resize is not None else own

            # Called at once, in this iteration: the loop's variables are the ones meant.
            def read() -> tuple[dict[str, Any], list[Any] | None]:
                tree = load_state(self.store, info.manifest, prefix=prefix,  # noqa: B023
                                  pieces=False)  # FSDP2's are read through DCP, below
                if resize is None or self._targets.loader is None:  # noqa: B023
                    return tree, None
                # Every old rank's data position, to deal a loader's epoch (ADR 0053).
                return tree, read_positions(self.store, info.manifest, resize)  # noqa: B023

            parts = read_together(self._group, info.seq, read, key=self.key)
            if parts is None:
                continue
            tree, positions = parts
            if shards_in(tree):  # FSDP2: every part's pieces, resharded by DCP (ADR 0054)
                from cairn.state.sharded import ShardLoad

                load = ShardLoad(tree, self._targets).run
                sharded = read_together(self._group, info.seq,
                                        lambda: load(self.store, self.key, info.seq),  # noqa: B023
                                        key=self.key)
                if sharded is None:
                    continue
                tree = sharded
            capture.check_compatible(tree, self._targets)
            tree = resized(tree, resize, positions=positions, seq=info.seq) if resize else tree
            capture.apply(tree, self._targets)
            if resize is not None:
                done = rescale_lr(self._targets, resize, self.resize_lr)
                if self._group.rank == 0:
                    log.warning("key %s: resizing %s: snapshot seq %d was taken by %d ranks; "
                                "%s", self.key, resize, info.seq, resize.from_ranks, done)
            self.resized = resize
            self.extras = dict(tree.get("extras") or {})
            self.restored_from = info.manifest
            self._attempt.resume_from(info.manifest)
            self._last_step = int(tree["step"])
            self.committed_seq, self.committed_step = info.seq, self._last_step
            log.info("key %s: resumed from seq %d (step %d)", self.key, info.seq, self._last_step)
            self._start_status()
            if self._status is not None:
                self._status.resumed(seq=info.seq, step=self._last_step)
            self._start_writer(staged_size(info.manifest, prefix))
            self.session.started(restored_from=info.seq)
            return self._last_step + 1
        self._start_writer(None)
        self._start_status()
        self.session.started(restored_from=None)
        return 0

    def _candidates(self) -> Iterator[SnapshotInfo]:
        """The snapshots to try restoring, newest first. One process: the attempt's parent
        first (``open_attempt`` found it: the newest whose manifest reads and whose packs
        exist, having logged any newer one it skipped), so that the log is listed again
        only if it fails. Distributed: rank 0's list, on every rank."""
        if not self._group.active:
            parent = self._attempt.parent
            if parent is not None:
                yield SnapshotInfo(self.key, parent.seq, parent.epoch, parent)
            for info in self.store.snapshots(self.key):
                if (parent is None or info.seq < parent.seq) and info.seq not in self.exclude_seqs:
                    with rollback.exits_when_refused(log):
                        rollback.refuse_older(self.key, info.seq, self._floor, self._mark)
                    yield info
            return
        snapshots = [i for i in self.store.snapshots(self.key) if i.seq not in self.exclude_seqs]
        count = self._group.broadcast([len(snapshots)])[0]  # rank 0's view decides
        yield from snapshots[:count]

    @property
    def epoch(self) -> int | None:
        """The epoch of this try's attempt on the key (opened by :meth:`restore`), None before:
        what an outcome record (:mod:`cairn.store.outcomes`) for this try is filed under."""
        return self._attempt.epoch if self._attempt is not None else None

    @property
    def mtbf_s(self) -> float | None:
        """Observed time between restarts of this key, whatever their cause (its attempts so
        far: :func:`~cairn.runtime.interval.observed_mtbf`); None with fewer than two. Read
        from the key's log the first time it is needed."""
        if not self._mtbf_known:
            self._require_restored()
            self._mtbf, self._mtbf_known = observed_mtbf(self.store, self.key), True
        return self._mtbf

    @mtbf_s.setter
    def mtbf_s(self, value: float | None) -> None:
        self._mtbf, self._mtbf_known = value, True

    def _start_writer(self, staged_size: int | None) -> None:
        """Start the writer process and prepare for the first snapshot, whose staging size is
        ``staged_size`` (None: measure the live state)."""
        if self.persist_mode is not PersistMode.PROCESS:
            return
        self._persister = Persister(key=self.key, buffers=self._buffer_count)
        staged = staged_size if staged_size is not None else self._expected_size()
        self._persister.start(store=self.store, attempt=self._attempt, staged=staged)

    def _expected_size(self) -> int | None:
        """The staging bytes the next snapshot needs, from the live state; None while an
        optimizer has parameters but no state yet (its state appears at its first step)."""
        assert self._targets is not None
        for opt in self._targets.optimizers.values():
            if not opt.state and any(group["params"] for group in opt.param_groups):
                return None
        try:
            _, arrays = flatten(capture.gather(self._targets, step=0, extras=self.extras))
            return plan([header_of(a).nbytes for a in arrays])[1]
        except CairnError:
            return None  # the first snapshot reports it

    def step(self, step: int) -> bool:
        """Call after ``step``'s optimizer update. Snapshots when the policy says so; returns
        whether it did. Raises :class:`~cairn.exceptions.Fenced` if a newer attempt exists."""
        self._require_restored()
        self._collect(raise_failures=True)
        triggers = self.session.triggers()
        notice, asked = triggers.notice, triggers.suspend
        policy = self.policy
        interval = self.interval_seconds()
        due = (policy.every_steps is not None and (step + 1) % policy.every_steps == 0) or (
            interval is not None and self.session.due(every_s=interval))
        if self._group.active:  # every rank snapshots together, or none does
            due, notice, asked = (bool(v) for v in self._group.all_max([due, notice, asked]))
        if notice:
            self._final_snapshot(step)
            return True
        if asked and self._suspended(step):
            return True
        if due:
            self.save(step)
        return due

    def interval_seconds(self) -> float | None:
        """The current time interval between snapshots (None: by steps only)."""
        policy = self.policy
        if policy.adaptive and self.snapshot_cost_s is not None and self.mtbf_s is not None:
            return young_daly_interval(snapshot_cost_s=self.snapshot_cost_s, mtbf_s=self.mtbf_s,
                                       lower_s=policy.min_seconds, upper_s=policy.max_seconds)
        if policy.every_seconds is None and policy.adaptive:
            return policy.max_seconds
        return policy.every_seconds

    def _final_snapshot(self, step: int) -> None:
        """A notice arrived: snapshot if the measured cost fits what is left (the session
        decides), then hand the signal on (to the handler installed before ours; where that
        was the default action, by raising :class:`~cairn.exceptions.PreemptedExit`: exit
        preempted, :mod:`cairn.runtime.exits`); or, when the pod's sidecar says its Job was
        suspended (a Kueue eviction, ADR 0028), record the ``suspended`` outcome and raise
        :class:`~cairn.exceptions.Suspended` instead."""
        assert self._notice is not None
        remaining = self._notice.remaining()
        name = self._notice.describe()
        if self._status is not None:
            self._status.notice(self._notice.source())
        if self._notice.signum is not None:
            self.session.cause.ask(signal_name=signal.Signals(self._notice.signum).name)
        seq = None
        try:
            final = self.session.final_snapshot(_StateSnapshotter(self, step),
                                                remaining_s=remaining,
                                                timeout_s=max(remaining, 0.0))
        except CairnError as e:
            log.error("%s: final snapshot failed: %s", name, e)
        else:
            if final.verdict is FinalVerdict.OVER_BUDGET:
                assert final.cost is not None
                log.warning("%s: no final snapshot: it takes about %.1fs and %.1fs are left",
                            name, final.cost.seconds, remaining)
            elif final.saved is not None:
                seq = final.saved.seq
                log.warning("%s: final snapshot seq %d at step %d", name, seq, step)
        evicted = self._evicted(seq=seq, what=f"step {step}")
        if evicted is not None:
            self._notice.uninstall()  # the signal is answered: no redelivery once the budget ends
            raise evicted
        message = f"{name} received; " + (f"final snapshot seq {seq} holds step {step}"
                                          if seq is not None else "no final snapshot")
        if self._notice.hand_on():  # no handler before ours: exit as cairn run does
            error = PreemptedExit(message, seq=seq, code=int(exits.preempted_code(seq)))
            self.session.end(session.end_of_error(error))
            raise error
        self.session.carry_on()  # the script's own handler decides whether training goes on
        raise Preempted(message, seq=seq)

    def _evicted(self, *, seq: int | None, what: str) -> Suspended | None:
        """After the final snapshot: the :class:`Suspended` to raise when the sidecar answered
        that the Job is suspended (the session's
        :meth:`~cairn.runtime.try_session.TrySession.after_cause`; its outcome recorded by
        rank 0), else None (a preemption; the answer's reason logged). Every rank learns rank
        0's answer."""
        assert self._notice is not None
        preempted = session.TryEnd(ending=session.Ending.PREEMPTED, saved=seq is not None)
        end = self.session.after_cause(preempted, budget_left_s=self._notice.remaining())
        cause = self.session.cause.cause
        if self.session.cause.asked_at is not None:
            if cause is None:
                log.warning("key %s: the sidecar did not say why the pod is stopping; a "
                            "preemption", self.key)
            elif not cause.suspended:
                log.warning("key %s: %s; a preemption", self.key, cause.reason)
        suspended = end.ending is session.Ending.SUSPENDED
        if self._group.active:
            suspended = bool(self._group.broadcast([int(suspended)])[0])
        if not suspended:
            return None
        reason = cause.reason if cause is not None else "rank 0's pod: its Job is suspended"
        error = suspend_mod.evicted(reason, seq=seq, what=what)
        log.warning("key %s: %s", self.key, error)
        if self._group.rank == 0:
            assert cause is not None
            endings.record_try(self, self.store.url, self.key, started_at=self._started_at,
                               error=error, detail={"cause": {"suspended": True,
                                                              "reason": cause.reason}})
            self.outcome_recorded = True
        self.session.end(session.end_of_error(error))
        return error

    def _suspended(self, step: int) -> bool:
        """A suspend request arrived: take a final snapshot (no deadline: a suspend has none),
        record the ``suspended`` outcome, raise :class:`~cairn.exceptions.Suspended`. When the
        snapshot cannot be taken now (the writer is busy and ``when_busy`` is SKIP, or it
        failed) training goes on and the next step tries again; returns False then."""
        request = self._suspend.request if self._suspend is not None else None
        try:
            final = self.session.final_snapshot(_StateSnapshotter(self, step), remaining_s=None)
        except Fenced:
            raise
        except CairnError as e:
            log.error("key %s: suspend requested %s, but the final snapshot failed (%s); "
                      "training goes on and the next step tries again", self.key,
                      suspend_mod.describe(request), e)
            self.session.carry_on()
            return False
        if final.saved is None:
            self.session.carry_on()
            return False
        error = suspend_mod.honoured(request, seq=final.saved.seq, what=f"step {step}")
        log.warning("key %s: %s (%.2fs after the request)", self.key, error,
                    suspend_mod.latency_s(request))
        if self._group.rank == 0:
            endings.record_try(self, self.store.url, self.key, started_at=self._started_at,
                               error=error, detail={"suspend": suspend_mod.detail(request)})
            self.outcome_recorded = True
        self.session.end(session.end_of_error(error))
        raise error

    def save(self, step: int, *, wait: bool = False,
             timeout: float | None = None) -> Manifest | None:
        """Snapshot now, as of after ``step``.

        Inline, or with ``wait=True``: returns the committed manifest, durable (None if the
        wait timed out). Otherwise returns None as soon as the state is staged; the writer
        process commits it in the background. Returns None, without snapshotting, when the
        previous snapshot is still persisting and ``when_busy`` is SKIP.
        """
        self._require_restored()
        assert self._targets is not None
        self._collect(raise_failures=True)
        started = time.monotonic()
        tree = capture.gather(self._targets, step=step, extras=self.extras)
        if self.persist_mode is PersistMode.INLINE:
            manifest = save_state(self._attempt, tree, step=step)
            self.session.snapshot_taken()
            self.last_stall_s = time.monotonic() - started
            self._record_cost(self.last_stall_s)
            self.last_snapshot = manifest
            self.committed_seq, self.committed_step = manifest.seq, step
            self._mark.record(manifest.seq)
            self._last_step = step
            self.stall_total_s += self.last_stall_s
            self.bytes_written_total += int(manifest.metadata.get("bytes_written", 0))
            if self._status is not None:
                self._status.committed(seq=manifest.seq, stall_s=self.last_stall_s,
                                       bytes_written=int(manifest.metadata.get("bytes_written", 0)))
            return manifest
        assert self._persister is not None
        staged = self._persister.stage(tree, step, group=self._group,
                                       skip_when_busy=self.when_busy is WhenBusy.SKIP,
                                       collect=self._collect)
        staged_at = time.monotonic()
        self.session.snapshot_taken()
        if not staged:
            self.skipped += 1
            return None
        self.last_stall_s = staged_at - started
        self._last_step = step
        if not wait:
            return None
        assert self._persister is not None
        if not self._persister.wait_idle(timeout):
            return None
        self._collect()
        if self.committed_step != step or self.committed_seq is None:
            raise StoreError(f"snapshot of step {step} failed: {self._last_error}")
        # Another rank's writer has persisted its part; rank 0's commits the record.
        self.last_snapshot = wait_for_record(self.store, self.key, self.committed_seq,
                                             timeout=timeout)
        return self.last_snapshot

    def _record_cost(self, seconds: float) -> None:
        self.snapshot_cost_s = seconds if self.snapshot_cost_s is None else \
            0.5 * self.snapshot_cost_s + 0.5 * seconds

    def _collect(self, *, raise_failures: bool = False) -> None:
        """Take the writer's reports: committed snapshots, failures, fencing. Raises Fenced;
        with ``raise_failures``, StoreError once ``max_failures`` snapshots in a row failed."""
        if self._persister is None:
            return
        for result in self._persister.take_results():
            if result.seq is not None:
                self.committed_seq, self.committed_step = result.seq, result.step
                self._mark.record(result.seq)
                self._record_cost((self.last_stall_s or 0.0) + result.seconds)
                self.stall_total_s += self.last_stall_s or 0.0
                self.bytes_written_total += result.bytes_written
                self._last_error = None
                self.failures = 0
                if self._status is not None:
                    self._status.committed(seq=result.seq, stall_s=self.last_stall_s or 0.0,
                                           bytes_written=result.bytes_written)
            else:
                self._last_error = result.error
                self.failures += 1
                if self._status is not None:
                    self._status.failed(result.error or "unknown error")
                log.error("key %s: snapshot of step %d was not committed (%d of %d allowed in a "
                          "row): %s", self.key, result.step, self.failures, self.max_failures,
                          result.error)
            if result.fenced:
                self._fenced = True
        if self._fenced or self._persister.fenced:
            self._fenced = True
            raise Fenced(f"key {self.key}: a newer attempt has taken over; this one must stop")
        if raise_failures and self.failures >= self.max_failures:
            raise StoreError(f"key {self.key}: {self.failures} snapshots in a row were not "
                             f"committed (max_failures={self.max_failures}); the last error: "
                             f"{self._last_error}")

    def _start_status(self) -> None:
        if self._status_file and self._group.rank == 0 and self._status is None:
            self._status = StatusReporter(self._status_file)

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (None in inline mode, or if it could not be started)."""
        return self._persister.pid if self._persister is not None else None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every staged snapshot is committed or failed; False on timeout."""
        if self._persister is None:
            return True
        done = self._persister.wait_idle(timeout)
        self._collect()
        return done

    def finish(self) -> None:
        """The whole step succeeded: mark the key done and drop its snapshots."""
        self._require_restored()
        if self._persister is not None and self._persister.writer is not None:
            self.wait()
            self._persister.writer.finish(timeout=600)
        else:
            self._attempt.finish()

    def close(self) -> None:
        """Release the store and the signal handlers. Every snapshot that ``step``/``save``
        reported is durable."""
        if self._notice is not None:
            self._notice.uninstall()
            self._notice = None
        error = None
        if self._persister is not None:
            self._persister.stop_warm_up()
            try:
                self.wait()
            except Fenced as e:
                error = e
            self._persister.close()
            self._persister = None
            if error is None and self._last_error is not None:
                error = StoreError(f"the last snapshot was not committed: {self._last_error}")
        if self._owns_store:
            self.store.close()
        if error is not None:
            raise error

    def _require_restored(self) -> None:
        if self._attempt is None:
            raise ConfigError("call restore(model=..., optimizer=...) before step() or save()")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StateSnapshotter:
    """The state mode's side of the try session
    (:class:`cairn.runtime.try_session.Snapshotter`): a snapshot of ``step`` awaited until
    durable."""

    def __init__(self, checkpointer: Checkpointer, step: int) -> None:
        self.checkpointer, self.step = checkpointer, step

    def cost(self) -> Cost | None:
        seconds = self.checkpointer.snapshot_cost_s
        return None if seconds is None else Cost(seconds, "it takes about")

    def blocked(self) -> str | None:
        return None

    def snapshot(self, *, final: bool, timeout_s: float | None) -> Saved | None:
        manifest = self.checkpointer.save(self.step, wait=True, timeout=timeout_s)
        return None if manifest is None else Saved(seq=manifest.seq)

    def stopped(self) -> bool:
        return False  # training stops only when the step raises
