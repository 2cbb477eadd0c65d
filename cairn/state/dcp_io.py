"""torch.distributed.checkpoint with a cairn store (ADR 0051): :func:`load` fills a state dict
from a state snapshot through DCP (:class:`~cairn.state.dcp_reader.StoreReader`), and
:func:`export` writes a snapshot in DCP's own layout, for users who leave."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from cairn.exceptions import ConfigError, CorruptSnapshot
from cairn.state.codec import Shard, shards_filled
from cairn.state.dcp_reader import LoadPlanner, StoreReader
from cairn.state.state_io import load_state
from cairn.store import Key, Manifest, Store
from cairn.store.verdicts import as_read_failure, reading


def load(state_dict: dict[str, Any], *, store: Store | str, key: Key | str,
         seq: int | None = None, rank: int = 0, process_group: Any = None) -> Manifest:
    """``dcp.load(state_dict, ...)`` from snapshot ``seq`` of ``key`` (default: the newest),
    every rank of ``process_group`` calling it (as with ``dcp.load``; none initialised: this
    process alone). Returns the snapshot's manifest.

    All or nothing: a snapshot that does not verify raises
    :class:`~cairn.exceptions.CorruptSnapshot` and a failure on this side (a library, a bug;
    on any rank) :class:`~cairn.exceptions.RestoreFailed`, never mistaken for a bad snapshot;
    ``state_dict`` is then left as it was on every rank that read nothing bad."""
    reader = StoreReader(store, key, seq=seq, rank=rank)
    with reading(reader.seq):
        # Before DCP: it reports a failed metadata read as a message in an AssertionError,
        # which would hide a bad state.json's verdict.
        reader.read_metadata()
    try:
        with reading(reader.seq), warnings.catch_warnings():
            # One process is what was asked for when no process group is initialised.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=LoadPlanner(),
                     process_group=process_group, no_dist=not _distributed())
    except CheckpointException as e:
        raise _cause(e, seq=reader.seq) from e
    return reader.manifest


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _cause(error: CheckpointException, *, seq: int) -> BaseException:
    """What DCP's wrapped per-rank failures mean: a failure on the reading side (any rank)
    before a store's verdict, so that a bad snapshot is never concluded from a bug."""
    failures = [as_read_failure(wrapped[0], seq=seq) for _, wrapped in
                sorted(error.failures.items())]
    for failure in failures:
        if not isinstance(failure, CorruptSnapshot):
            return failure
    return failures[0] if failures else error


def export(store: Store, key: Key | str, dest: str, *, seq: int | None = None,
           rank: int = 0) -> Manifest:
    """Write snapshot ``seq`` of ``key`` (default: the newest; of a snapshot several ranks
    took, rank ``rank``'s part, its sharded tensors whole from every part) into the new or empty directory ``dest`` in DCP's own layout
    (``FileSystemWriter``: its ``.metadata`` and ``__0_0.distcp``), loadable with
    ``dcp.load(state_dict, checkpoint_id=dest)``. The snapshot is read and verified whole
    first; ``dest`` appears only once DCP has written everything. Returns its manifest."""
    reader = StoreReader(store, key, seq=seq, rank=rank)
    dest = os.path.abspath(dest)
    if os.path.lexists(dest) and not (os.path.isdir(dest) and not os.path.islink(dest)
                                      and not os.listdir(dest)):
        raise ConfigError(f"{dest} exists and is not an empty directory; name a new one")
    partial = f"{dest}.cairn-partial"
    if os.path.lexists(partial):
        raise ConfigError(f"{partial} is left from an export that did not finish; remove it")
    tree = load_state(reader.store, reader.manifest, prefix=reader.prefix)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tree = _assembled(tree, reader)  # a sharded tensor whole, from every part's pieces
        dcp.save(tree, storage_writer=dcp.FileSystemWriter(partial), no_dist=True)
    if os.path.isdir(dest):
        os.rmdir(dest)  # empty, checked above
    os.rename(partial, dest)
    return reader.manifest


def _assembled(tree: dict[str, Any], reader: StoreReader) -> dict[str, Any]:
    """``tree`` with each sharded tensor's piece replaced by the whole tensor, read by this
    process alone from every part's pieces."""
    dest = _wholes(tree)
    if dest is None:
        return tree
    dcp.load(dest, storage_reader=reader, planner=LoadPlanner(), no_dist=True)
    return shards_filled(tree, dest)


def _wholes(tree: Any) -> Any:
    """An empty whole tensor for each :class:`Shard` of ``tree``, at its path; None if none."""
    if isinstance(tree, Shard):
        return torch.empty(tree.shape, dtype=tree.local.dtype)
    if isinstance(tree, dict):
        found = {k: w for k, v in tree.items() if (w := _wholes(v)) is not None}
        return found or None
    return None
