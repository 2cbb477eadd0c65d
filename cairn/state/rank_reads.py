"""Reads across the ranks of a distributed run: one snapshot read by every rank of a restore
together, and the one verdict they reach on it (ADR 0037: only a store's verdict skips a
snapshot); and a snapshot's record, which rank 0 commits once every rank's part is there."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from cairn.exceptions import CorruptSnapshot, NotFound, RestoreFailed, StoreError
from cairn.runtime import exits
from cairn.state.distributed import Group
from cairn.store import Key, Manifest, Store
from cairn.store.verdicts import reading, restore_failed_exit

log = logging.getLogger("cairn.state.checkpointer")

T = TypeVar("T")


def read_together(group: Group, seq: int, read: Callable[[], T], *, key: object) -> T | None:
    """``read()`` on this rank, then one collective over ``group``: the result when every
    rank's read verified; None when a rank's part did not (logged there; every rank then tries
    the previous snapshot). A failure on the reading side, on any rank (a library, a bug, out
    of memory), stops every rank with :class:`~cairn.exceptions.RestoreFailedExit` (exit 8),
    and no snapshot is skipped."""
    result: T | None = None
    failure: RestoreFailed | None = None
    try:
        with reading(seq):
            result = read()
    except CorruptSnapshot as e:
        log.warning("key %s: skipping snapshot seq %d: %s", key, seq, e)
    except RestoreFailed as e:
        failure = e
    # One collective for both: 0 a rank failed on its side, 1 a rank's part did not verify,
    # 2 every part read.
    verdict = group.all_min([2 if result is not None else int(failure is None)])[0]
    if verdict == 0:
        raise restore_failed_exit(failure or RestoreFailed(
            f"reading snapshot seq {seq} failed on another rank (its log names the cause); no "
            "snapshot was skipped and every snapshot stays in place", seq=seq),
            code=exits.ExitCode.RESTORE_FAILED, logger=log)
    return result if verdict == 2 else None


#: How long a rank waits for rank 0 to commit a snapshot whose part it persisted.
RECORD_WAIT_SECONDS = 600.0


def wait_for_record(store: Store, key: Key, seq: int, *, timeout: float | None) -> Manifest:
    """Snapshot ``seq``'s manifest, waiting until its record is there: a rank other than 0
    hears from its writer that its part persisted before rank 0's writer commits the record
    (the record of a single process is there already). Raises StoreError after ``timeout``
    (default :data:`RECORD_WAIT_SECONDS`)."""
    deadline = time.monotonic() + (RECORD_WAIT_SECONDS if timeout is None else timeout)
    while True:
        try:
            return store.manifest(key, seq)
        except NotFound:
            if time.monotonic() >= deadline:
                raise StoreError(f"key {key}: rank 0 did not commit snapshot seq {seq} "
                                 "(this rank's part of it persisted)") from None
            time.sleep(0.05)
