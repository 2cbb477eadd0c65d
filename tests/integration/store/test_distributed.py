"""Distributed snapshots: every rank commits a part; rank 0's one ``snap`` makes them visible."""

from __future__ import annotations

import random
import time

import pytest

from cairn.exceptions import ConfigError, Fenced, StoreError
from cairn.store import Key, Store

KEY = Key(("dag", "ddp-train", "run-1", "0"))


def rank_data(rank: int, step: int) -> bytes:
    return random.Random(rank * 1000 + step).randbytes(150_000)


def test_parts_become_one_snapshot(store: Store, tmp_path) -> None:
    rank0 = store.open_attempt(KEY)
    others = [store.join_attempt(KEY, epoch=rank0.epoch) for _ in range(2)]
    seq = rank0.log.next_seq  # rank 0 broadcasts this
    for rank, attempt in enumerate([rank0, *others]):
        with attempt.snapshot() as snap:
            snap.add_bytes("shard.bin", rank_data(rank, 1))
            snap.commit_part(seq=seq, rank=rank, step=1)
        if rank == 1:  # not all parts yet: nothing visible, and rank 0 is told who is missing
            assert store.snapshots(KEY) == []
            with pytest.raises(StoreError, match=r"ranks \[2\]"):
                rank0.commit_parts(seq, world_size=3)
    manifest = rank0.commit_parts(seq, world_size=3, step=1)
    assert manifest.seq == seq and manifest.metadata["world_size"] == 3
    assert [f.path for f in manifest.files] == [f"rank-{r}/shard.bin" for r in range(3)]
    store.restore(KEY, tmp_path / "out")
    for rank in range(3):
        assert (tmp_path / "out" / f"rank-{rank}" / "shard.bin").read_bytes() == rank_data(rank, 1)
    assert list(store.backend.list(f"keys/{KEY.path}/@parts/")) == []


def test_wrong_seq_and_zombie_parts(store: Store) -> None:
    zombie = store.open_attempt(KEY)
    zseq = zombie.log.next_seq
    retry = store.open_attempt(KEY)
    with pytest.raises(ConfigError, match="next seq"):
        retry.commit_parts(zseq, world_size=1)
    with zombie.snapshot() as snap:
        snap.add_bytes("shard.bin", b"zombie")
        snap.commit_part(seq=zseq, rank=0)
    with pytest.raises(Fenced):
        zombie.commit_parts(zseq, world_size=1)
    # The retry's own parts at its next seq are not confused with the zombie's.
    seq = retry.log.next_seq
    with retry.snapshot() as snap:
        snap.add_bytes("shard.bin", b"retry")
        snap.commit_part(seq=seq, rank=0)
    assert retry.commit_parts(seq, world_size=1).epoch == retry.epoch


def test_gc_removes_stale_parts_but_keeps_live_ones_packs(store: Store) -> None:
    attempt = store.open_attempt(KEY)
    seq = attempt.log.next_seq
    with attempt.snapshot() as snap:
        snap.add_bytes("shard.bin", rank_data(0, 1))
        part = snap.commit_part(seq=seq, rank=0)
    report = store.gc(grace_seconds=3600)
    assert report.deleted == [] and report.stale_parts_removed == 0
    assert report.packs_referenced == len(part.packs())
    time.sleep(1.1)
    report = store.gc(grace_seconds=1.0)
    assert report.stale_parts_removed == 1
    assert list(store.backend.list(f"keys/{KEY.path}/@parts/")) == []
    assert sorted(report.deleted) == sorted(part.packs())
