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

``CairnKubernetesPodOperator``'s tries run in pods, which the worker only watches: the seq kept
in the task state store becomes the new pod's annotation ``cairn.dev/committed-seqs``
(:func:`seed_for_pod`), which the pod's sidecar copies into the pod's committed-seq files
before the main container starts and patches as the try commits (``--owner-pod``,
:mod:`cairn.k8s.committed`); the worker reads the annotation back (:class:`PodKeptSeq`) every
:data:`POD_POLL_S` while the pod runs, and once more when it has ended, after waiting for the
sidecar to publish the last commit (:func:`final_seq_from_pod`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

#: The task state store's key for the committed seq.
TASK_STATE_KEY = "cairn_committed_seq"
#: How a seq copied from the task state store is named in refusals.
SOURCE = f"Airflow's task state store (key {TASK_STATE_KEY!r})"
#: How often the worker reads a running pod's annotation (one GET of the pod).
POD_POLL_S = 10.0
#: How long the worker waits, once the main container has ended, for the sidecar to publish
#: the last commit and stop (it does both within the pod's grace).
SIDECAR_END_WAIT_S = 30.0


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
    kept = _seq_kept(accessor, mark, unread="only this worker's record protects this try")
    if kept is not None and mark.record(kept, source=SOURCE):
        log.info("cairn: an earlier try of %s committed snapshot seq %d (kept in %s)", key,
                 kept, SOURCE)
    mirror = rollback.MarkMirror(mark, lambda entry: accessor.set(TASK_STATE_KEY, entry),
                                 published=kept)
    threaded = comms_take_threads()
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


def comms_take_threads() -> bool:
    """Whether the task's channel to its supervisor serializes callers from any thread (the
    worker's ``CommsDecoder`` does); ``dag.test()``'s in-process comms remove
    ``SUPERVISOR_COMMS`` while they serve a call, so a second thread's call fails."""
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import CommsDecoder

    return isinstance(getattr(task_runner, "SUPERVISOR_COMMS", None), CommsDecoder)


def kept_seq(context: Mapping[str, Any], store_url: str, key: Any) -> int | None:
    """The seq the task state store keeps for ``key`` in the store at ``store_url``; None when
    none is kept, there is no task state store, or it cannot be read (logged)."""
    from cairn.runtime import rollback

    accessor = context.get("task_state_store")
    if accessor is None:
        return None
    return _seq_kept(accessor, rollback.local_mark(store_url, str(key)),
                     unread="a new pod of this task is not told what earlier tries committed")


def _seq_kept(accessor: Any, mark: Any, *, unread: str) -> int | None:
    """``mark``'s seq as the task state store keeps it; None when none is kept or it cannot be
    read (logged, ending with ``unread``: what the try goes on without)."""
    try:
        return mark.seq_in(accessor.get(TASK_STATE_KEY))
    except Exception as e:  # noqa: BLE001 - the worker's or pod's own record still protects
        log.warning("cairn: could not read the committed seq from %s (%s): %s", SOURCE, e,
                    unread)
        return None


def seed_for_pod(store_url: str, key: Any, seq: int) -> str:
    """The annotation ``cairn.dev/committed-seqs`` a new pod of the task gets for the ``seq``
    the task state store keeps (:func:`kept_seq`)."""
    from cairn.k8s import render_committed_seqs
    from cairn.runtime import rollback

    mark = rollback.local_mark(store_url, str(key))
    return render_committed_seqs({(mark.store_url, mark.key): seq})


class PodKeptSeq:
    """The seq of one store and key that a pod's annotation keeps, read with ``read_pod`` (the
    operator's API client; a ``V1Pod``): a :class:`cairn.runtime.rollback.KeptSeq` for
    ``MarkMirror``."""

    def __init__(self, read_pod: Callable[[], Any], store_url: str, key: Any) -> None:
        from cairn.runtime import rollback

        self.read_pod = read_pod
        self.mark = rollback.local_mark(store_url, str(key))

    def read(self) -> int | None:
        return self.seq_in(self.read_pod())

    def seq_in(self, pod: Any) -> int | None:
        from cairn.k8s import COMMITTED_SEQS_ANNOTATION, parse_committed_seqs

        metadata = getattr(pod, "metadata", None)
        annotations = getattr(metadata, "annotations", None) or {}
        entries = parse_committed_seqs(
            annotations.get(COMMITTED_SEQS_ANNOTATION),
            where=f"the annotation of pod {getattr(metadata, 'name', '?')}")
        return entries.get((self.mark.store_url, self.mark.key))

    def entry(self, seq: int) -> dict[str, Any]:
        return self.mark.entry(seq)


def final_seq_from_pod(kept: PodKeptSeq, pod: Any, *, wait_s: float = SIDECAR_END_WAIT_S,
                       poll_s: float = 0.5) -> int | None:
    """The seq the ended pod's annotation keeps, read once the pod's cairn sidecar has ended
    (it publishes the last commit on its way out, after the main container), or once
    ``wait_s`` has passed; ``pod`` is the pod as last read. A read that fails is logged and
    the last one read is used."""
    deadline = time.monotonic() + wait_s
    while not _sidecar_ended(pod) and time.monotonic() < deadline:
        time.sleep(poll_s)
        try:
            pod = kept.read_pod()
        except Exception as e:  # noqa: BLE001 - the pod may be gone: use what was read
            log.warning("cairn: could not read the pod for its committed seqs: %s", e)
            break
    return kept.seq_in(pod)


def _sidecar_ended(pod: Any) -> bool:
    from cairn.k8s import SIDECAR_NAME

    status = getattr(pod, "status", None)
    for c in (getattr(status, "init_container_statuses", None) or []):
        if getattr(c, "name", None) == SIDECAR_NAME:
            state = getattr(c, "state", None)
            return getattr(state, "terminated", None) is not None
    return True  # no sidecar status (the pod never started it): nothing to wait for
