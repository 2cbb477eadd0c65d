"""Dealing the rest of an interrupted epoch of a ``DistributedSampler`` to another number of
ranks (:mod:`cairn.state.data_position`): every index delivered exactly once, except the
padding the deal states; a sampler's plan that holds for its epoch only; a loader that
continues a dealt epoch from a snapshot of it."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset

from cairn.state import data_position, loader_workers
from cairn.state.data_position import Plan

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
StatefulDistributedSampler = pytest.importorskip(
    "torchdata.stateful_dataloader.sampler").StatefulDistributedSampler

warnings.filterwarnings("ignore", message=".*set_vital.*")


def positions(length: int, ranks: int, delivered: list[int], *, shuffle: bool = True,
              drop_last: bool = False, epoch: int = 3) -> list[dict[str, Any]]:
    return [{"epoch": epoch, "seed": 7, "shuffle": shuffle, "drop_last": drop_last,
             "num_replicas": ranks, "rank": r, "dataset_len": length, "delivered": d,
             "dealt": None} for r, d in enumerate(delivered)]


def sequence(length: int, ranks: int, rank: int, *, shuffle: bool = True,
             drop_last: bool = False, epoch: int = 3) -> list[int]:
    sampler = DistributedSampler(range(length), num_replicas=ranks, rank=rank, shuffle=shuffle,
                                 seed=7, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize(("length", "n", "m", "per_rank"), [
    (100, 2, 3, 40), (101, 3, 2, 20), (23, 4, 5, 3), (100, 2, 2, 0), (7, 1, 4, 7),
    (64, 4, 1, 16), (10, 3, 4, 1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_index_once_except_the_stated_padding(length: int, n: int, m: int,
                                                    per_rank: int, shuffle: bool) -> None:
    old = [sequence(length, n, r, shuffle=shuffle) for r in range(n)]
    delivered = [min(per_rank, len(s)) for s in old]
    before = [i for s, d in zip(old, delivered) for i in s[:d]]
    dealt = [data_position.deal(positions(length, n, delivered, shuffle=shuffle), to_ranks=m,
                                rank=j, seq=1) for j in range(m)]
    after = [i for d in dealt for i in d.plan.indices]
    assert set(before) | set(after) == set(range(length))
    # Never an index the old ranks delivered dealt again; repeats only the old sampler's own
    # padding (at most n - 1, delivered before) and the deal's (at most m - 1, after).
    assert not set(before) & set(after)
    assert len(before) - len(set(before)) <= n - 1
    assert len(after) - len(set(after)) <= m - 1
    assert len({len(d.plan.indices) for d in dealt}) == 1  # every rank as many: DDP in step
    assert all(d.dropped == () for d in dealt)
    assert all(d.plan.epoch == 3 for d in dealt)


def test_drop_last_drops_and_states_a_tail_of_less_than_the_new_world() -> None:
    length, n, m = 101, 2, 3
    old = [sequence(length, n, r, drop_last=True) for r in range(n)]
    before = [i for s in old for i in s[:10]]
    dealt = [data_position.deal(positions(length, n, [10, 10], drop_last=True), to_ranks=m,
                                rank=j, seq=1) for j in range(m)]
    after = [i for d in dealt for i in d.plan.indices]
    assert len(after) == len(set(after)) and not set(before) & set(after)
    dropped = set(dealt[0].dropped)
    assert all(set(d.dropped) == dropped for d in dealt) and len(dropped) < m
    # What the old sampler itself dropped (drop_last: 1 of 101 on 2 ranks) stays dropped.
    assert set(before) | set(after) | dropped == set(itertools.chain(*old))
    assert len(set(range(length)) - (set(before) | set(after) | dropped)) == 1


def test_positions_of_different_epochs_or_samplers_are_not_dealt() -> None:
    mixed = positions(100, 2, [10, 10])
    mixed[1] = {**mixed[1], "epoch": 4}
    with pytest.raises(ValueError, match="not one epoch of one sampler"):
        data_position.deal(mixed, to_ranks=3, rank=0, seq=5)
    missing = positions(100, 3, [10, 10, 10])[:2]  # a part of a 3-rank snapshot only
    with pytest.raises(ValueError, match="not one epoch"):
        data_position.deal(missing, to_ranks=2, rank=0, seq=5)


@pytest.mark.parametrize("kind", [DistributedSampler, StatefulDistributedSampler])
def test_a_plan_holds_for_its_epoch_only(kind: type) -> None:
    sampler = kind(range(20), num_replicas=2, rank=1, shuffle=True, seed=1)
    sampler.set_epoch(2)
    normal = list(sampler)
    data_position.install(sampler, Plan(epoch=2, indices=(5, 3, 9)))
    assert isinstance(sampler, kind)
    assert list(sampler) == [5, 3, 9] and len(sampler) == 3
    assert list(sampler) == [5, 3, 9]  # the epoch iterated again, as DistributedSampler does
    sampler.set_epoch(3)
    assert len(sampler) == 10 and type(sampler) is kind
    sampler.set_epoch(2)
    assert list(sampler) == normal  # spent: the plan is gone with its epoch


@pytest.mark.parametrize("kind", [DistributedSampler, StatefulDistributedSampler])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_snapshot_in_a_dealt_epoch_continues_it_on_as_many_ranks(kind: type,
                                                                    workers: int) -> None:
    data = list(range(40))

    def loader() -> Any:
        sampler = kind(data, num_replicas=2, rank=0, shuffle=True, seed=1)
        return StatefulDataLoader(data, batch_size=3, sampler=sampler, num_workers=workers)

    first = loader()
    data_position.Dealt(plan=Plan(epoch=1, indices=tuple(range(30, 15, -1)))).apply(first)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    position = data_position.capture(first, state)
    assert position is not None and position["delivered"] == 6 and position["epoch"] == 1
    assert position["dealt"].tolist() == list(range(30, 15, -1))
    rest = [b.tolist() for b in it]

    second = loader()  # a restarted rank: its sampler at epoch 0, no plan
    data_position.reinstate(second, position)
    second.load_state_dict(state)
    assert [b.tolist() for b in second] == rest
    assert sum(seen + rest, []) == list(range(30, 15, -1))


def test_capture_and_refusal_name_what_cannot_be_dealt() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(5))

    plain = StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True)
    assert data_position.capture(plain, plain.state_dict()) is None
    assert "DistributedSampler" in (data_position.refusal(plain) or "")
    stream = StatefulDataLoader(Stream(), batch_size=2)
    assert "IterableDataset" in (data_position.refusal(stream) or "")
    torch_loader = torch.utils.data.DataLoader(
        list(range(8)), sampler=DistributedSampler(list(range(8)), num_replicas=1, rank=0))
    assert "StatefulDataLoader" in (data_position.refusal(torch_loader) or "")


def test_a_restore_puts_the_samplers_epoch_back_before_the_iterator_is_made() -> None:
    # The restored iterator is created inside restore(), before the script's set_epoch: a
    # DistributedSampler draws its order then, so without the epoch put back a resume in
    # epoch 2 took epoch 0's order.
    data = list(range(40))

    def loader() -> Any:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        return sampler, StatefulDataLoader(data, batch_size=4, sampler=sampler)

    sampler, first = loader()
    sampler.set_epoch(2)
    it = iter(first)
    next(it)
    state = first.state_dict()
    position = data_position.capture(first, state)
    rest = [b.tolist() for b in it]
    sampler, second = loader()
    data_position.reinstate(second, position)
    second.load_state_dict(state)
    loader_workers.resume_iterator(second)
    sampler.set_epoch(2)
    assert [b.tolist() for b in second] == rest
