"""A restore on another number of ranks than the snapshot was taken by (issue 35, ADR 0052).

Replicated training (plain DDP) resizes: every rank's part of the snapshot holds the whole
model, optimizer, schedulers, scalers and named items, so a rank that existed in the snapshot
(rank < N) loads its own part and a rank the resize adds loads rank 0's (sharded tensors
aside, below). RNGs: ranks below
min(N, M) keep theirs; an added rank gets states derived from rank 0's by
:func:`cairn.state.rng.derived`. The step is the snapshot's.

A ``loader=`` (torchdata's ``StatefulDataLoader`` under a ``DistributedSampler``) resumes the
interrupted epoch with what no old rank delivered dealt to the new ranks
(:mod:`cairn.state.data_position`): every rank reads every old rank's recorded position.

FSDP2 (``fully_shard``: DTensor parameters sharded on dim 0 over a 1-D mesh) resizes through
DCP: every rank's pieces are read and resharded to the new layout (:mod:`cairn.state.sharded`).

Refused, with the reason, before anything loads: other DTensor layouts (HSDP's 2-D mesh,
tensor parallel), FSDP1, ``ZeroRedundancyOptimizer``, another loader, and a snapshot whose loader position was not recorded (taken before cairn recorded
it). ``resize=False`` on the Checkpointer refuses every resize, as before, and so do the
Lightning and Hugging Face integrations, which keep the loader's position in their own
trainer state.

The global batch is the script's: cairn cannot see it. After a resize,
``Checkpointer.resized`` says N -> M, and a script that keeps the global batch divides it by
M (or accumulates gradients); one that keeps the per-rank batch trains on M/N of the
snapshot's global batch and picks a learning-rate rule (:class:`~cairn.state.options.
LrScaling`, :func:`rescale_lr`), applied once, at the resize, and logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cairn.exceptions import CorruptSnapshot
from cairn.state import data_position, rng
from cairn.state.capture import StateMismatch, Targets
from cairn.state.codec import array_indices, unflatten
from cairn.state.distributed import Group
from cairn.state.options import LrScaling
from cairn.state.state_io import read_arrays, read_state_doc
from cairn.store import Manifest, Store


@dataclass(frozen=True)
class Resize:
    """This rank's view of a restore from ``from_ranks`` ranks onto ``to_ranks``."""

    from_ranks: int
    to_ranks: int
    rank: int

    @property
    def added(self) -> bool:
        """Whether this rank did not exist when the snapshot was taken."""
        return self.rank >= self.from_ranks

    @property
    def source_rank(self) -> int:
        """Whose part of the snapshot this rank loads."""
        return 0 if self.added else self.rank

    @property
    def prefix(self) -> str:
        return f"rank-{self.source_rank}/" if self.from_ranks > 1 else ""

    def __str__(self) -> str:
        return f"{self.from_ranks} -> {self.to_ranks} ranks"


#: Why a Checkpointer made with ``resize=False`` refuses a resize.
REFUSED_BY_OPTION = "resize=False refuses to reshard"


def resize_for(manifest: Manifest, group: Group, targets: Targets, *,
               refusal: str | None) -> Resize | None:
    """None when ``manifest`` was taken by ``group``'s number of ranks; else this rank's
    :class:`Resize`. Raises :class:`StateMismatch` when the resize is refused: ``refusal``
    (why, when the caller refuses every resize) or what :func:`unsupported` names."""
    taken = int(manifest.metadata.get("world_size", 1))
    if taken == group.world_size:
        return None
    if refusal is not None:
        raise StateMismatch(
            f"snapshot seq {manifest.seq} was taken by {taken} ranks and this run has "
            f"{group.world_size}, and {refusal}. Run with {taken} ranks, or start fresh by "
            "removing the key (cairn rm STORE KEY)")
    problems = unsupported(targets)
    if problems:
        raise StateMismatch(
            f"snapshot seq {manifest.seq} was taken by {taken} ranks and this run has "
            f"{group.world_size}; cairn cannot resize it (nothing was loaded):\n  "
            + "\n  ".join(problems) + f"\nRun with {taken} ranks, or start fresh by removing "
            "the key (cairn rm STORE KEY). Resizing works for plain DDP and FSDP2 "
            "(fully_shard on a 1-D mesh), with or without a StatefulDataLoader under a "
            "DistributedSampler.")
    return Resize(from_ranks=taken, to_ranks=group.world_size, rank=group.rank)


def unsupported(targets: Targets) -> list[str]:
    """What keeps ``targets`` from resizing, one line each; empty when they can."""
    problems: list[str] = []
    dtensor, fsdp1, zero = _sharded_types()
    for name, model in targets.models.items():
        if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
            problems.append(f"model {name!r} is wrapped in FullyShardedDataParallel (FSDP1)")
            continue
        layouts = {_layout(p) for p in model.parameters() if dtensor is not None
                   and isinstance(p, dtensor)} - {FSDP2_LAYOUT}
        if layouts:
            problems.append(f"model {name!r} has DTensor parameters laid out as "
                            f"{', '.join(sorted(layouts))} (HSDP, tensor parallel): cairn "
                            f"reshards FSDP2's only ({FSDP2_LAYOUT})")
    for name, opt in targets.optimizers.items():
        if zero is not None and isinstance(opt, zero):
            problems.append(f"optimizer {name!r} is a ZeroRedundancyOptimizer (sharded state)")
    if targets.loader is not None:
        refused = data_position.refusal(targets.loader)
        if refused is not None:
            problems.append(refused)
    return problems


def read_positions(store: Store, manifest: Manifest, resize: Resize) -> list[Any]:
    """Every old rank's recorded data position (None where a part records none), read and
    verified from the parts' ``state.json`` (and a dealt plan's array)."""
    reader = store.reader(manifest)
    positions: list[Any] = []
    for rank in range(resize.from_ranks):
        doc = read_state_doc(reader, prefix=f"rank-{rank}/" if resize.from_ranks > 1 else "")
        try:  # the tree's top level: {"$dict": [[name, value], ...]}
            raw = dict(doc.structure["$dict"]).get("data")
        except (KeyError, TypeError, ValueError):
            raise CorruptSnapshot(f"seq {manifest.seq}: {doc.prefix}state.json is not a "
                                  "state tree", seq=manifest.seq) from None
        arrays = read_arrays(reader, doc, sorted(array_indices(raw))) if raw else {}
        positions.append(unflatten(raw, arrays) if raw is not None else None)
    return positions


def resized(tree: dict[str, Any], resize: Resize, *, positions: list[Any] | None,
            seq: int) -> dict[str, Any]:
    """``tree`` (the part of rank ``resize.source_rank``) as this rank restores it: an
    added rank's RNGs derived from the source's; with ``positions`` (a loader), its loader
    state replaced by this rank's :class:`~cairn.state.data_position.Dealt` share of the
    epoch's rest. Raises StateMismatch when a part recorded no position."""
    if resize.added:
        tree = {**tree, "rng": rng.derived(tree["rng"], rank=resize.rank)}
    if positions is not None:
        if any(not isinstance(p, dict) for p in positions):
            raise StateMismatch(
                f"snapshot seq {seq} holds no data position for its loader (taken before "
                "cairn recorded one, or its loader had no DistributedSampler): it cannot be "
                f"dealt from {resize}. Run with {resize.from_ranks} ranks, or start fresh")
        try:
            dealt = data_position.deal(positions, to_ranks=resize.to_ranks, rank=resize.rank,
                                       seq=seq)
        except ValueError as e:
            raise StateMismatch(f"{e}: cairn cannot deal it from {resize}. Run with "
                                f"{resize.from_ranks} ranks, or start fresh") from None
        tree = {**tree, "loader": dealt}
    return tree


#: How FSDP2's ``fully_shard`` lays out a parameter, the DTensor layout cairn reshards.
FSDP2_LAYOUT = "Shard(dim=0) over a 1-D mesh"


def _layout(param: Any) -> str:
    placements = ", ".join(repr(p) for p in param.placements)
    return f"{placements} over a {param.device_mesh.ndim}-D mesh"


def rescale_lr(targets: Targets, resize: Resize, rule: LrScaling) -> str:
    """Apply ``rule`` to every optimizer's learning rates (each param group's ``lr`` and
    ``initial_lr``) and every scheduler's ``base_lrs`` and last rates, after the restore; say
    what was done, for the log."""
    ratio = resize.to_ranks / resize.from_ranks
    factor = {LrScaling.KEEP: 1.0, LrScaling.LINEAR: ratio, LrScaling.SQRT: math.sqrt(ratio)}[rule]
    if rule is LrScaling.KEEP:
        return "learning rates kept: keeping the global batch is the script's " \
            "(Checkpointer.resized)"
    for opt in targets.optimizers.values():
        for group in opt.param_groups:
            for name in ("lr", "initial_lr"):
                if isinstance(group.get(name), torch.Tensor):
                    group[name].mul_(factor)  # a tensor lr (capturable) stays the same tensor
                elif name in group:
                    group[name] = group[name] * factor
    for sched in targets.schedulers.values():
        for name in ("base_lrs", "_last_lr"):
            if isinstance(getattr(sched, name, None), list):
                setattr(sched, name, [lr * factor for lr in getattr(sched, name)])
    return f"learning rates times {factor:.6g} ({rule.value} rule, {resize})"


def _sharded_types() -> tuple[Any, Any, Any]:
    """torch's DTensor, FSDP1 and ZeroRedundancyOptimizer types (Nones without
    torch.distributed)."""
    if not torch.distributed.is_available():
        return None, None, None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return DTensor, FullyShardedDataParallel, ZeroRedundancyOptimizer
