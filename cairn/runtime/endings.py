"""A try's outcome record, and marking a key done: written once for every mode.

The outcome record (:class:`cairn.store.outcomes.Outcome`) is what the next try's resume plan
and the placement policy read, and what the UI shows. Which outcome a try's end comes to is
:func:`cairn.runtime.session.conclude`'s to say, for every mode: :func:`record_try` (a
state-mode try's exception), :func:`record_exit` (``cairn run``'s conclusion) and
:func:`record_observed` (a pod that ended without its supervisor reporting it) only write it.

Recording is best effort (:func:`record_best_effort`): an outcome is advice, and failing to
write it never changes how a try ends. Imports neither torch nor an orchestrator.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime import env, slurm
from cairn.runtime.session import Conclusion, conclude, end_of_error
from cairn.store.outcomes import Outcome, OutcomeKind, Progress, TrySummary, summarize_log

log = logging.getLogger(__name__)


def error_detail(error: BaseException) -> str:
    """How an error is named in an outcome's detail (one bounded line)."""
    return f"{type(error).__name__}: {error}"[:500]


def with_slurm_job(outcome: Outcome, environ: Any = None) -> Outcome:
    """``outcome`` with ``detail["slurm"]``: the SLURM job it ran in (job id, try from
    ``SLURM_RESTART_COUNT``, node; :meth:`cairn.runtime.slurm.SlurmJob.detail`) unless it
    names one already or runs outside SLURM (or SLURM's variables cannot be read: logged)."""
    if "slurm" in outcome.detail:
        return outcome
    try:
        job = slurm.job_from_env(environ)
    except ConfigError as e:
        log.warning("the outcome names no SLURM job: %s", e)
        return outcome
    if job is None:
        return outcome
    return dataclasses.replace(outcome, detail={**outcome.detail, "slurm": job.detail()})


def placement_options(environ: Any = None) -> tuple[str, ...]:
    """The step's capacity option names from ``$CAIRN_PLACEMENT_OPTIONS`` (a JSON list);
    empty when unset or malformed (logged: an outcome is advice)."""
    text = env.PLACEMENT_OPTIONS.get(environ)
    if not text:
        return ()
    try:
        names = json.loads(text)
        if isinstance(names, list) and all(isinstance(n, str) and n for n in names):
            return tuple(names)
    except ValueError:
        pass
    log.warning("%s is not a JSON list of option names (%r); not recorded",
                env.PLACEMENT_OPTIONS.name, text[:200])
    return ()


def try_summary(store: Any, key: Any, epoch: int, *, last_seq: int | None = None,
                last_step: int | None = None, bytes_written: int | None = None,
                stall_s: float | None = None) -> TrySummary | None:
    """What try ``epoch`` did, for its outcome record: the slot log's figures
    (:func:`~cairn.store.outcomes.summarize_log`; its count is exact) completed by what the
    try measured itself (its last snapshot, its bytes written and its stalls, over every
    snapshot it committed, retention or not). None when the log cannot be read."""
    try:
        live = summarize_log(store.history(key), epoch)
    except Exception as e:  # noqa: BLE001 - a summary is advice
        log.warning("key %s: could not summarize try %d: %s", key, epoch, e)
        return None
    return dataclasses.replace(
        live,
        last_seq=live.last_seq if live.last_seq is not None else last_seq,
        last_step=live.last_step if live.last_step is not None else last_step,
        bytes_written=bytes_written if bytes_written is not None else live.bytes_written,
        stall_s=None if stall_s is None else round(stall_s, 4),
        complete=live.complete or bytes_written is not None)


def record_best_effort(store: Any, key: Any, outcome: Outcome) -> bool:
    """``store.records.record_outcome(key, outcome)``, logging instead of raising (module docstring).
    The placement the try ran with (``$CAIRN_PLACEMENT_OPTION``/``_REASON``, and the step's
    options, ``$CAIRN_PLACEMENT_OPTIONS``) is taken from the environment when the outcome has
    none; an outcome without a summary gets the slot log's (:func:`try_summary`). Returns
    whether the record was written."""
    option = env.PLACEMENT_OPTION.get()
    if outcome.option is None and option:
        outcome = dataclasses.replace(outcome, option=option,
                                      reason=outcome.reason or env.PLACEMENT_REASON.get())
    if not outcome.options:
        outcome = dataclasses.replace(outcome, options=placement_options())
    if outcome.summary is None:
        outcome = dataclasses.replace(outcome, summary=try_summary(store, key, outcome.epoch))
    try:
        store.records.record_outcome(key, with_slurm_job(outcome))
        return True
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("key %s: could not record try %d's outcome (%s): %s", key, outcome.epoch,
                    outcome.outcome.value, e)
        return False


def record_try(ckpt: Any, url: str, key: Any, *, started_at: float,
               error: BaseException | None, detail: dict[str, Any] | None = None) -> None:
    """Leave the outcome record of the state-mode try ``ckpt`` ran (best effort; the
    Checkpointer's epoch names the try): a user error is recorded before the try fails, so a
    try without a record was killed from outside. Nothing is recorded when ``ckpt`` never
    opened an attempt, or already recorded its own (``ckpt.outcome_recorded``)."""
    epoch = getattr(ckpt, "epoch", None) if ckpt is not None else None
    if epoch is None or getattr(ckpt, "outcome_recorded", False):
        return  # never opened, or it recorded its own (a suspension, say)
    from cairn.runtime.stores import open_store

    restored = ckpt.restored_from
    info: dict[str, Any] = {"mode": "state", **(detail or {})}
    if error is not None:
        info["error"] = error_detail(error)
    outcome = Outcome(
        epoch=epoch, outcome=conclude(end_of_error(error)).outcome, started_at=started_at,
        ended_at=max(time.time(), started_at),
        progress=Progress(start_step=(restored.step + 1) if restored is not None
                          and restored.step is not None else 0,
                          kept_step=ckpt.committed_step, snapshot_seq=ckpt.committed_seq),
        snapshot_cost_s=ckpt.snapshot_cost_s, detail=info)
    try:
        with open_store(url, create=False) as store:  # the Checkpointer's may be closed
            outcome = dataclasses.replace(outcome, summary=try_summary(
                store, key, epoch, last_seq=ckpt.committed_seq, last_step=ckpt.committed_step,
                bytes_written=getattr(ckpt, "bytes_written_total", None),
                stall_s=getattr(ckpt, "stall_total_s", None)))
            record_best_effort(store, key, outcome)
    except Exception as e:  # noqa: BLE001 - an outcome must never change how the try ends
        log.warning("cairn: could not record this try's outcome: %s", e)


def record_exit(store: Any, key: Any, *, epoch: int, conclusion: Conclusion, started_at: float,
                snapshot_seq: int | None = None,
                snapshot_cost_s: float | None = None, frozen_s: float | None = None,
                gpu_stall_s: float | None = None, stall_s: float | None = None,
                bytes_written: int | None = None,
                detail: dict[str, Any] | None = None) -> bool:
    """Leave the outcome record of a process-mode try that ended as ``conclusion`` says (its
    try session's :meth:`~cairn.runtime.try_session.TrySession.end`); best effort. ``frozen_s`` / ``gpu_stall_s``: the try's
    total CRIU frozen time and GPU stall; ``stall_s`` / ``bytes_written``: its dumps' total
    wall time and new bytes, for its summary."""
    outcome = Outcome(
        epoch=epoch, outcome=conclusion.outcome,
        started_at=started_at, ended_at=max(time.time(), started_at),
        progress=Progress(snapshot_seq=snapshot_seq), snapshot_cost_s=snapshot_cost_s,
        frozen_s=frozen_s, gpu_stall_s=gpu_stall_s,
        detail={"mode": "process", "exit_code": None if conclusion.exit_code is None
                else int(conclusion.exit_code), **(detail or {})},
        summary=try_summary(store, key, epoch, last_seq=snapshot_seq,
                            bytes_written=bytes_written, stall_s=stall_s))
    return record_best_effort(store, key, outcome)


def record_observed(store: Any, key: Any, *, epoch: int, kind: OutcomeKind, started_at: float,
                    option: str | None = None, reason: str | None = None,
                    options: tuple[str, ...] = (),
                    detail: dict[str, Any] | None = None) -> Outcome | None:
    """Leave the outcome record a try could not write itself, as its orchestrator observed it
    (a pod the node ended, say); best effort: the record written, or None. ``options``: the
    step's capacity option names."""
    outcome = Outcome(epoch=epoch, outcome=kind, started_at=started_at,
                      ended_at=max(time.time(), started_at), option=option, reason=reason,
                      options=options, detail=dict(detail or {}))
    return outcome if record_best_effort(store, key, outcome) else None


def mark_done(ckpt: Any, url: str, key: Any) -> None:
    """The step succeeded: mark ``key`` done (its snapshots go). Through the Checkpointer when
    it restored (its writer commits in order), else directly in the store when someone (a
    subprocess using ``Checkpointer.from_env()``) wrote to the key. Durable when it returns."""
    if ckpt is not None and getattr(ckpt, "epoch", None) is not None:
        ckpt.finish()
        return
    from cairn.runtime.stores import open_store
    from cairn.store.slotlog import RecordKind

    with open_store(url) as store:
        history = store.history(key)
        if history and history[-1].kind is not RecordKind.DONE:
            store.open_attempt(key, note={"mode": "finish"}).finish()
