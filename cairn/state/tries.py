"""How an orchestrated try of a state-mode step ends: its outcome record and the key's ``done``.

Shared by every wrapper that runs a user's function with a :class:`Checkpointer` (the Airflow
operator on a worker, ``@task.cairn(pod=...)`` inside a pod, KFP components), so that each
records the same outcome for the same ending and marks the key done the same way. Imports
neither torch nor an orchestrator.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cairn.exceptions import Fenced, Preempted
from cairn.store.outcomes import Outcome, OutcomeKind, Progress, record_best_effort

log = logging.getLogger(__name__)

def outcome_kind(error: BaseException | None) -> OutcomeKind:
    """The outcome a try that ended with ``error`` (None: it succeeded) is recorded as."""
    if error is None:
        return OutcomeKind.SUCCEEDED
    if isinstance(error, Preempted):
        return OutcomeKind.PREEMPTED
    if isinstance(error, Fenced):
        return OutcomeKind.FENCED
    return OutcomeKind.FAILED


def exit_code(error: BaseException) -> int | None:
    """``cairn run``'s exit code for a preemption (75: final snapshot committed, 76: not) or a
    fence (5); None for any other error. The same codes in both modes, so that whatever reads a
    container's exit code maps them alike."""
    from cairn.process.supervisor import EXIT_FENCED, EXIT_PREEMPTED_KEPT, EXIT_PREEMPTED_SAVED

    if isinstance(error, Preempted):
        return EXIT_PREEMPTED_SAVED if error.seq is not None else EXIT_PREEMPTED_KEPT
    if isinstance(error, Fenced):
        return EXIT_FENCED
    return None


def record_try(ckpt: Any, url: str, key: Any, *, started_at: float,
               error: BaseException | None, detail: dict[str, Any] | None = None) -> None:
    """Leave the outcome record of the try ``ckpt`` ran (best effort; the Checkpointer's epoch
    names the try): a user error is recorded before the try fails, so a try without a record
    was killed from outside. Nothing is recorded when ``ckpt`` never opened an attempt."""
    epoch = getattr(ckpt, "epoch", None) if ckpt is not None else None
    if epoch is None:
        return
    from cairn.store import open_store

    restored = ckpt.restored_from
    info: dict[str, Any] = {"mode": "state", **(detail or {})}
    if error is not None:
        info["error"] = f"{type(error).__name__}: {error}"[:500]
    outcome = Outcome(
        epoch=epoch, outcome=outcome_kind(error), started_at=started_at,
        ended_at=max(time.time(), started_at),
        progress=Progress(start_step=(restored.step + 1) if restored is not None
                          and restored.step is not None else 0,
                          kept_step=ckpt.committed_step, snapshot_seq=ckpt.committed_seq),
        snapshot_cost_s=ckpt.snapshot_cost_s, detail=info)
    try:
        with open_store(url, create=False) as store:  # the Checkpointer's may be closed
            record_best_effort(store, key, outcome)
    except Exception as e:  # noqa: BLE001 - an outcome must never change how the try ends
        log.warning("cairn: could not record this try's outcome: %s", e)


def mark_done(ckpt: Any, url: str, key: Any) -> None:
    """The step succeeded: mark ``key`` done (its snapshots go). Through the Checkpointer when
    it restored (its writer commits in order), else directly in the store when someone (a
    subprocess using ``Checkpointer.from_env()``) wrote to the key. Durable when it returns."""
    if ckpt is not None and getattr(ckpt, "epoch", None) is not None:
        ckpt.finish()
        return
    from cairn.store import open_store
    from cairn.store.slotlog import RecordKind

    with open_store(url) as store:
        history = store.history(key)
        if history and history[-1].kind is not RecordKind.DONE:
            store.open_attempt(key, note={"mode": "finish"}).finish()
