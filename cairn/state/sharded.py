"""Sharded tensors (FSDP2's DTensor parameters and optimizer moments) restored through
torch.distributed.checkpoint, onto as many ranks as took the snapshot or another number
(issue 35, ADR 0054).

A snapshot stores each rank's local piece of a DTensor with the global shape and the piece's
offsets (:class:`cairn.state.codec.Shard`). On a restore, every :class:`Shard` of the tree is
replaced by a new DTensor laid out as the live object it will be loaded into (the model's
parameter, or the optimizer moment's parameter), and ``dcp.load`` fills those from the pieces
of every part of the snapshot (:class:`cairn.state.dcp_reader.StoreReader` serves them all,
verified), resharding them to this run's layout; the tree then loads as any other. Every rank
runs :meth:`ShardLoad.run` together (DCP's collectives).
"""

from __future__ import annotations

from typing import Any

from cairn.state.capture import StateMismatch, Targets
from cairn.state.codec import Shard, shards_filled, shards_in
from cairn.state.dcp_io import load as dcp_load
from cairn.store import Key, Store


class ShardLoad:
    """The DTensors a tree's shards load into, made (and checked against the live objects)
    before anything is read. Raises StateMismatch when a shard has no live object to take its
    layout from, or another global shape."""

    def __init__(self, tree: dict[str, Any], targets: Targets) -> None:
        self.tree = tree
        self._found = shards_in(tree)
        self._dest: dict[str, Any] = {}
        live = _Live(targets)
        for path, shard in self._found:
            template = live.template(path)
            if tuple(template.shape) != shard.shape:
                raise StateMismatch(f"{'.'.join(map(str, path))}: the snapshot holds "
                                    f"{shard.shape}, the live object {tuple(template.shape)}")
            _set(self._dest, path, _empty_like(template, shard))

    def run(self, store: Store, key: Key, seq: int) -> dict[str, Any]:
        """The tree with its shards replaced by the DTensors, filled by DCP from every part of
        snapshot ``seq`` (every rank together); raises as :func:`cairn.state.dcp_io.load`."""
        dcp_load(self._dest, store=store, key=key, seq=seq)
        return shards_filled(self.tree, self._dest)


class _Live:
    """The live DTensors a shard's path names: a model's parameter or buffer, or for an
    optimizer's state the parameter it belongs to (each model's state dict made once)."""

    def __init__(self, targets: Targets) -> None:
        self._targets = targets
        self._models: dict[str, dict[str, Any]] = {}

    def template(self, path: tuple[Any, ...]) -> Any:
        from torch.distributed.tensor import DTensor

        models, optimizers = self._targets.models, self._targets.optimizers
        live: Any = None
        if len(path) == 3 and path[0] == "models" and path[1] in models:
            if path[1] not in self._models:
                self._models[path[1]] = models[path[1]].state_dict()
            live = self._models[path[1]].get(path[2])
        elif len(path) == 5 and path[0] == "optimizers" and path[2] == "state" \
                and path[1] in optimizers and isinstance(path[3], int):
            params = [p for group in optimizers[path[1]].param_groups for p in group["params"]]
            live = params[path[3]] if 0 <= path[3] < len(params) else None
        if not isinstance(live, DTensor):
            raise StateMismatch(f"{'.'.join(map(str, path))} is sharded in the snapshot, and "
                                "the live objects have no sharded (DTensor) parameter for it: "
                                "build the model with the same fully_shard() calls before "
                                "restore()")
        return live


def _empty_like(template: Any, shard: Shard) -> Any:
    from torch.distributed.tensor import empty

    return empty(*shard.shape, dtype=shard.local.dtype, device_mesh=template.device_mesh,
                 placements=template.placements)


def _set(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


__all__ = ["ShardLoad"]
