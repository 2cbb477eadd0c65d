"""Rollback refused on every worker (ADR 0049): the newest snapshot seq a task's tries
committed is kept in Airflow's task state store (Airflow 3.3), which follows the task instance
from try to try whichever worker runs it, and which the bucket's writers do not reach.

Around each try, :func:`kept_by_airflow`:

- reads the value (under :data:`TASK_STATE_KEY`, the task instance's scope) and copies its
  seq into this worker's committed-seq file (:mod:`cairn.runtime.rollback`), which the
  Checkpointer or ``cairn run`` then reads: a try that would begin older than it is refused,
  naming the task state store;
- publishes the file's newest seq back to the task state store while the try runs, from a
  thread of its own and at most a poll (1 s) behind the commit: a commit never waits on the
  API server. A worker lost in the second after a commit may leave that seq unpublished; the
  snapshots committed before it are covered. Under ``dag.test()``, whose in-process comms
  serve one thread at a time, it is published once, when the try ends.

The value lives as long as Airflow's ``[state_store] default_retention_days`` (30 by
default) and is dropped with the task instance's state (``clear_on_success``); a key marked
done refuses nothing anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

#: The task state store's key for the committed seq.
TASK_STATE_KEY = "cairn_committed_seq"
#: How a seq copied from the task state store is named in refusals.
SOURCE = f"Airflow's task state store (key {TASK_STATE_KEY!r})"


@contextmanager
def kept_by_airflow(context: Mapping[str, Any], store_url: str, key: Any, *,
                    environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """Keep ``key``'s committed seq in the task state store while the block runs a try of it
    (see the module docstring); ``environ``: the try's environment, where it is not this
    process's (it names the committed-seq directory). Without a task state store (not a task
    run by Airflow 3.3), or when it cannot be read, only this worker's file protects the try:
    logged."""
    from cairn.runtime import rollback

    accessor = context.get("task_state_store")
    if accessor is None:
        log.warning("cairn: no task state store in this task's context: a retry on another "
                    "worker cannot tell whether snapshots were deleted behind its back")
        yield
        return
    mark = rollback.local_mark(store_url, str(key), environ)
    try:
        kept = mark.seq_in(accessor.get(TASK_STATE_KEY))
    except Exception as e:  # noqa: BLE001 - this worker's record still protects the try
        log.warning("cairn: could not read the committed seq from %s (%s): only this worker's "
                    "record protects this try", SOURCE, e)
        kept = None
    if kept is not None and mark.record(kept, source=SOURCE):
        log.info("cairn: an earlier try of %s committed snapshot seq %d (kept in %s)", key,
                 kept, SOURCE)
    mirror = rollback.MarkMirror(mark, lambda entry: accessor.set(TASK_STATE_KEY, entry),
                                 published=kept)
    threaded = _comms_take_threads()
    if threaded:
        mirror.start()
    else:
        log.info("cairn: this task's supervisor comms serve one thread (dag.test()): the "
                 "committed seq is kept in %s when the try ends, not as it commits", SOURCE)
    try:
        yield
    finally:
        if threaded:
            mirror.stop()
        else:
            mirror.sync()


def _comms_take_threads() -> bool:
    """Whether the task's channel to its supervisor serializes callers from any thread (the
    worker's ``CommsDecoder`` does); ``dag.test()``'s in-process comms remove
    ``SUPERVISOR_COMMS`` while they serve a call, so a second thread's call fails."""
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import CommsDecoder

    return isinstance(getattr(task_runner, "SUPERVISOR_COMMS", None), CommsDecoder)
