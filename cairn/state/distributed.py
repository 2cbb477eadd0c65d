"""The few collective operations a distributed Checkpointer needs, over torch.distributed.

Only integers cross the wire (as tensors, never pickled objects). Without an initialised
process group everything degrades to a single process: rank 0 of 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world_size: int = 1

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @classmethod
    def detect(cls) -> Group:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def _tensor(self, values: list[int]) -> Any:
        device = "cpu"
        if torch.distributed.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        return torch.tensor(values, dtype=torch.int64, device=device)

    def broadcast(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank."""
        if not self.active:
            return values
        tensor = self._tensor(values)
        torch.distributed.broadcast(tensor, src=0)
        return [int(v) for v in tensor.tolist()]

    def all_max(self, values: list[int]) -> list[int]:
        return self._all_reduce(values, torch.distributed.ReduceOp.MAX)

    def all_min(self, values: list[int]) -> list[int]:
        return self._all_reduce(values, torch.distributed.ReduceOp.MIN)

    def _all_reduce(self, values: list[int], op: Any) -> list[int]:
        if not self.active:
            return values
        tensor = self._tensor(values)
        torch.distributed.all_reduce(tensor, op=op)
        return [int(v) for v in tensor.tolist()]
