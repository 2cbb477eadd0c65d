"""Where each rank was in its epoch of a distributed sampler, and the rest of that epoch dealt
to another number of ranks (issue 35, ADR 0053).

A loader that is torchdata's ``StatefulDataLoader`` over a map-style dataset, sampled by torch's
``DistributedSampler`` or torchdata's ``StatefulDistributedSampler``, has its place recorded
with every snapshot (:func:`capture`, the tree's ``data``): the sampler's epoch, seed, shuffle,
``drop_last``, world and rank, the dataset's length, and the indices this rank's loader
delivered in batches it yielded (torchdata's ``samples_yielded``: batches prefetched but not
yielded are not counted).

On a resize from N ranks to M (:func:`deal`), every old rank's sequence for the epoch is
rebuilt (by a ``DistributedSampler`` of the recorded settings: torch's own order), what the N
loaders delivered is removed, and the rest, in the order the old ranks would have taken it,
is dealt round-robin to the M new ranks. So every index of the interrupted epoch is delivered
exactly once, except (``drop_last=False``) up to M - 1 indices the deal repeats from the start
of the rest, as ``DistributedSampler`` pads; with ``drop_last=True`` up to M - 1 indices of the
rest are dropped, and said so.

A new rank's sampler yields its dealt indices for that epoch only (:class:`Plan`: the sampler
instance's class is swapped for a subclass whose ``__iter__`` and ``__len__`` follow the plan
while ``sampler.epoch`` is the plan's, then swaps back). The plan is recorded with the
snapshots taken during the dealt epoch, so a later restore, on as many ranks or another number,
continues it. Every restore also puts the sampler's epoch back before the loader's iterator is
created (the iterator draws its order at creation, before the script's ``set_epoch``).

Refused, with the reason: an ``IterableDataset`` (its sharding is its own), another sampler,
another loader.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

_PLAN = "_cairn_plan"  # the sampler instance's attribute holding its Plan
_SETTINGS = ("epoch", "seed", "shuffle", "drop_last", "num_replicas", "dataset_len")


@dataclass(frozen=True)
class Plan:
    """The indices one rank's sampler yields in ``epoch`` instead of its own order."""

    epoch: int
    indices: tuple[int, ...]


def distributed_sampler(loader: Any) -> Any:
    """The loader's ``DistributedSampler`` (torchdata's stateful one included), or None."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, DistributedSampler) else None


def refusal(loader: Any) -> str | None:
    """Why the data position of ``loader`` cannot be dealt to another number of ranks; None
    when it can."""
    from torch.utils.data import IterableDataset

    from cairn.state.loader_workers import is_stateful_loader

    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return ("loader=: an IterableDataset shards itself, so its position cannot be dealt "
                "to another number of ranks")
    if not is_stateful_loader(loader) or distributed_sampler(loader) is None:
        return (f"loader=: a {type(loader).__name__} with sampler "
                f"{type(getattr(loader, 'sampler', None)).__name__}: cairn deals the data "
                "position of a torchdata StatefulDataLoader sampled by DistributedSampler or "
                "StatefulDistributedSampler")
    return None


def capture(loader: Any, loader_state: Any) -> dict[str, Any] | None:
    """This rank's place in its epoch, for the snapshot's ``data``; None when the loader has
    no distributed sampler (nothing to deal) or its state says nothing of what it delivered."""
    sampler = distributed_sampler(loader)
    if sampler is None or refusal(loader) is not None:
        return None
    delivered = _samples_yielded(loader_state)
    if delivered is None:
        return None
    plan = _active_plan(sampler)
    return {"epoch": int(sampler.epoch), "seed": int(sampler.seed),
            "shuffle": bool(sampler.shuffle), "drop_last": bool(sampler.drop_last),
            "num_replicas": int(sampler.num_replicas), "rank": int(sampler.rank),
            "dataset_len": len(sampler.dataset), "delivered": delivered,
            "dealt": (torch.tensor(plan.indices, dtype=torch.int64)
                      if plan is not None else None)}


def _samples_yielded(state: Any) -> int | None:
    # StatefulDataLoader's state: in the main process's snapshot with workers, at the top
    # without; its batch sampler's iterator counts the indices of the batches yielded.
    if not isinstance(state, dict):
        return None
    snapshot = state.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else state
    iter_state = main.get("_sampler_iter_state") if isinstance(main, dict) else None
    count = iter_state.get("samples_yielded") if isinstance(iter_state, dict) else None
    return count if isinstance(count, int) else None


def reinstate(loader: Any, position: Any) -> None:
    """Before the loader's state is loaded on as many ranks as took the snapshot: the
    sampler's epoch back, and the dealt plan when the snapshot was taken in a dealt epoch."""
    sampler = distributed_sampler(loader)
    if sampler is None or not isinstance(position, dict):
        return
    sampler.set_epoch(int(position["epoch"]))
    dealt = position.get("dealt")
    if dealt is not None:
        install(sampler, Plan(epoch=int(position["epoch"]),
                              indices=tuple(int(i) for i in dealt.tolist())))


@dataclass(frozen=True)
class Dealt:
    """What a resized rank's loader does instead of loading an old rank's state: start the
    epoch afresh with ``plan``."""

    plan: Plan
    dropped: tuple[int, ...] = ()

    def apply(self, loader: Any) -> None:
        sampler = distributed_sampler(loader)
        if sampler is None:  # refusal() ran before anything loaded; a bug if reached
            raise AssertionError("a dealt data position needs a DistributedSampler")
        sampler.set_epoch(self.plan.epoch)
        if hasattr(sampler, "next_yielded"):
            sampler.next_yielded = None  # torchdata's sampler: nothing of the old to skip
        install(sampler, self.plan)


def deal(positions: Sequence[dict[str, Any]], *, to_ranks: int, rank: int, seq: int) -> Dealt:
    """This rank's part of what the old ranks (``positions``, one per old rank, in rank
    order) had not delivered of their epoch. Raises ValueError when the positions do not
    describe one epoch of one sampler."""
    first = positions[0]
    for r, p in enumerate(positions):
        if any(p.get(name) != first.get(name) for name in _SETTINGS) or p.get("rank") != r \
                or p.get("num_replicas") != len(positions):
            raise ValueError(f"the ranks' data positions in seq {seq} are not one epoch of "
                             f"one sampler (rank {r}: {_brief(p)}; rank 0: {_brief(first)})")
    rest = _undelivered([_sequence(p) for p in positions],
                        [int(p["delivered"]) for p in positions])
    if first["drop_last"]:
        kept = len(rest) // to_ranks * to_ranks
        rest, dropped = rest[:kept], tuple(rest[kept:])
    else:
        total = math.ceil(len(rest) / to_ranks) * to_ranks
        rest = rest + (rest * math.ceil(total / len(rest)))[:total - len(rest)] if rest else rest
        dropped = ()
    return Dealt(plan=Plan(epoch=int(first["epoch"]), indices=tuple(rest[rank::to_ranks])),
                 dropped=dropped)


def _brief(position: dict[str, Any]) -> str:
    return ", ".join(f"{name} {position.get(name)!r}" for name in (*_SETTINGS, "rank"))


def _sequence(position: dict[str, Any]) -> list[int]:
    """The indices the old rank's sampler yields in the epoch: its dealt plan, or what a
    ``DistributedSampler`` of its settings yields (torch's own order and padding)."""
    if position.get("dealt") is not None:
        return [int(i) for i in position["dealt"].tolist()]
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(range(int(position["dataset_len"])),
                                 num_replicas=int(position["num_replicas"]),
                                 rank=int(position["rank"]), shuffle=bool(position["shuffle"]),
                                 seed=int(position["seed"]),
                                 drop_last=bool(position["drop_last"]))
    sampler.set_epoch(int(position["epoch"]))
    return list(DistributedSampler.__iter__(sampler))


def _undelivered(sequences: list[list[int]], delivered: list[int]) -> list[int]:
    """The indices no old rank delivered, each once, in the order the old ranks would have
    taken them (round-robin, as the sampler dealt them)."""
    seen = {i for seq_, n in zip(sequences, delivered) for i in seq_[:n]}
    rest: list[int] = []
    tails = [seq_[n:] for seq_, n in zip(sequences, delivered)]
    for k in range(max((len(t) for t in tails), default=0)):
        for tail in tails:
            if k < len(tail) and tail[k] not in seen:
                seen.add(tail[k])
                rest.append(tail[k])
    return rest


# -- the sampler's one-epoch plan -------------------------------------------------------------

_RESUMED: dict[type, type] = {}


def install(sampler: Any, plan: Plan) -> None:
    """Make ``sampler`` yield ``plan.indices`` while its epoch is ``plan.epoch``."""
    base = _base(type(sampler))
    if base not in _RESUMED:
        _RESUMED[base] = type(f"Dealt{base.__name__}", (base,),
                              {"__iter__": _plan_iter, "__len__": _plan_len,
                               "__module__": __name__})
    setattr(sampler, _PLAN, plan)
    sampler.__class__ = _RESUMED[base]


def _base(cls: type) -> type:
    return cls.__bases__[0] if cls in _RESUMED.values() else cls


def _active_plan(sampler: Any) -> Plan | None:
    plan = sampler.__dict__.get(_PLAN)
    if plan is not None and plan.epoch == sampler.epoch:
        return plan
    if plan is not None:  # another epoch was set: the plan is spent
        del sampler.__dict__[_PLAN]
        sampler.__class__ = _base(type(sampler))
    return None


def _plan_iter(self: Any) -> Iterator[int]:
    plan = _active_plan(self)
    if plan is None:
        return iter(self)  # the class is the base's again
    return _yield_planned(self, plan.indices)


def _yield_planned(sampler: Any, indices: tuple[int, ...]) -> Iterator[int]:
    # torchdata's StatefulDistributedSampler counts what it yielded and skips what its
    # loaded state says was: the plan keeps both.
    stateful = hasattr(sampler, "next_yielded")
    start = 0
    if stateful:
        start = sampler.next_yielded or 0
        sampler.next_yielded = None
        sampler.yielded = start
    for index in indices[start:]:
        if stateful:
            sampler.yielded += 1
        yield index


def _plan_len(self: Any) -> int:
    plan = _active_plan(self)
    return len(plan.indices) if plan is not None else len(self)
