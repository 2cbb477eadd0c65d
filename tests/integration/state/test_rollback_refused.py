"""Rollback refused (ADR 0049), with real torch state and the Checkpointer: a bucket writer
deletes the newest snapshots behind the key's back, and the next try on this machine refuses
to begin from an older one, naming both seqs, until the rollback is allowed. No false refusal
after retention, `done`, `cairn rm` or garbage collection. Every backend (local, GCS and S3
through their server processes), plain and encrypted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cairn import open_store
from cairn.exceptions import RollbackRefused
from cairn.runtime.rollback import local_mark
from cairn.store import Key, Store, StoreSettings
from cairn.store.slotlog import record_name
from tests.support.committed_tries import committed_try

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



def test_deleting_the_newest_snapshots_is_refused_naming_both_seqs(any_store: Store) -> None:
    ckpt, _ = committed_try(any_store, KEY, 3)
    ckpt.close()
    newest, older = any_store.snapshots(KEY)[:2]
    any_store.raw_backend.delete(record_name(KEY.path, newest.seq))  # behind the key's back
    with pytest.raises(RollbackRefused) as refused:
        committed_try(any_store, KEY, 1)
    text = str(refused.value)
    assert f"a try committed snapshot seq {newest.seq}, but the newest this store offers is " \
           f"snapshot seq {older.seq}" in text
    assert local_mark(any_store.url, str(KEY)).path in text and "CAIRN_ALLOW_ROLLBACK=1" in text
    assert (refused.value.recorded, refused.value.found) == (newest.seq, older.seq)
    # A bare script that lets it propagate exits 9, not 1: a retry would refuse the same.
    assert isinstance(refused.value, SystemExit) and refused.value.code == 9
    assert [i.seq for i in any_store.snapshots(KEY)] == [older.seq], "nothing was written"
    ckpt, start = committed_try(any_store, KEY, 1, allow_rollback=True)  # the user says so
    ckpt.close()
    assert start == older.manifest.step + 1
    again, _ = committed_try(any_store, KEY, 1)  # the mark moved on with the new commit: no refusal
    again.close()


def test_deleting_every_snapshot_is_refused(any_store: Store) -> None:
    ckpt, _ = committed_try(any_store, KEY, 2)
    ckpt.close()
    for info in any_store.snapshots(KEY):
        any_store.raw_backend.delete(record_name(KEY.path, info.seq))
    with pytest.raises(RollbackRefused, match="the newest this store offers is no snapshot"):
        committed_try(any_store, KEY, 1)


def test_no_false_refusal_after_retention_gc_done_or_rm(any_store: Store) -> None:
    ckpt, _ = committed_try(any_store, KEY, 5)  # keep_last=2: retention deleted three
    ckpt.close()
    any_store.gc(grace_seconds=0)
    any_store.gc(grace_seconds=0)  # S3 deletes what the first pass condemned
    ckpt, start = committed_try(any_store, KEY, 1)
    assert start == 5
    ckpt.finish()  # the step succeeded: `done`
    ckpt.close()
    ckpt, start = committed_try(any_store, KEY, 2)  # after `done`: a fresh start, not a rollback
    assert start == 0
    ckpt.close()
    any_store.remove(KEY)  # `cairn rm`
    ckpt, start = committed_try(any_store, KEY, 1)
    assert start == 0
    ckpt.close()
