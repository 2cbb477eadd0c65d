"""Rollback refused (ADR 0049), with real torch state and the Checkpointer: a bucket writer
deletes the newest snapshots behind the key's back, and the next try on this machine refuses
to begin from an older one, naming both seqs, until the rollback is allowed. No false refusal
after retention, `done`, `cairn rm` or garbage collection. Every backend (local, GCS and S3
through their server processes), plain and encrypted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from cairn import open_store
from cairn.exceptions import RollbackRefused
from cairn.runtime.rollback import local_mark
from cairn.state import Checkpointer
from cairn.state.checkpointer import PersistMode
from cairn.store import Key, Store, StoreSettings
from cairn.store.slotlog import record_name

KEY = Key.parse("dag/rollback/run-1/0")


@pytest.fixture(params=["local", "gcs", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path, store_secret) -> Iterator[Store]:  # noqa: ANN001
    if request.param == "local":
        url = str(tmp_path / "store")
    elif request.param == "gcs":
        url = f"gs://{request.getfixturevalue('gcs_bucket')}/rollback"
    else:
        url = f"s3://{request.getfixturevalue('s3_bucket')}/rollback"
    store = open_store(url, secret=store_secret, settings=StoreSettings(keep_last=2))
    try:
        yield store
    finally:
        store.close()


def _train(store: Store, steps: int, **options: object) -> tuple[Checkpointer, int]:
    """A try: restore, then ``steps`` committed snapshots (inline: each durable on return)."""
    model = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(store=store, key=KEY, every_steps=1, every_seconds=None,
                        persist=PersistMode.INLINE, preemption=None, **options)
    start = ckpt.restore(model=model)
    for step in range(start, start + steps):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.step(step)
    return ckpt, start


def test_deleting_the_newest_snapshots_is_refused_naming_both_seqs(any_store: Store) -> None:
    ckpt, _ = _train(any_store, 3)
    ckpt.close()
    newest, older = any_store.snapshots(KEY)[:2]
    any_store.raw_backend.delete(record_name(KEY.path, newest.seq))  # behind the key's back
    with pytest.raises(RollbackRefused) as refused:
        _train(any_store, 1)
    text = str(refused.value)
    assert f"a try committed snapshot seq {newest.seq}, but the newest this store offers is " \
           f"snapshot seq {older.seq}" in text
    assert local_mark(any_store.url, str(KEY)).path in text and "CAIRN_ALLOW_ROLLBACK=1" in text
    assert (refused.value.recorded, refused.value.found) == (newest.seq, older.seq)
    assert [i.seq for i in any_store.snapshots(KEY)] == [older.seq], "nothing was written"
    ckpt, start = _train(any_store, 1, allow_rollback=True)  # the user says so
    ckpt.close()
    assert start == older.manifest.step + 1
    again, _ = _train(any_store, 1)  # the mark moved on with the new commit: no refusal
    again.close()


def test_deleting_every_snapshot_is_refused(any_store: Store) -> None:
    ckpt, _ = _train(any_store, 2)
    ckpt.close()
    for info in any_store.snapshots(KEY):
        any_store.raw_backend.delete(record_name(KEY.path, info.seq))
    with pytest.raises(RollbackRefused, match="the newest this store offers is no snapshot"):
        _train(any_store, 1)


def test_no_false_refusal_after_retention_gc_done_or_rm(any_store: Store) -> None:
    ckpt, _ = _train(any_store, 5)  # keep_last=2: retention deleted three
    ckpt.close()
    any_store.gc(grace_seconds=0)
    any_store.gc(grace_seconds=0)  # S3 deletes what the first pass condemned
    ckpt, start = _train(any_store, 1)
    assert start == 5
    ckpt.finish()  # the step succeeded: `done`
    ckpt.close()
    ckpt, start = _train(any_store, 2)  # after `done`: a fresh start, not a rollback
    assert start == 0
    ckpt.close()
    any_store.remove(KEY)  # `cairn rm`
    ckpt, start = _train(any_store, 1)
    assert start == 0
    ckpt.close()
