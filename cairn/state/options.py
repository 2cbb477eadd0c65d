"""The Checkpointer's options: when it snapshots (:class:`SnapshotPolicy`), where a snapshot is
persisted (:class:`PersistMode`) and what a snapshot does while the previous one persists
(:class:`WhenBusy`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cairn.exceptions import ConfigError


@dataclass(frozen=True)
class SnapshotPolicy:
    """When :meth:`Checkpointer.step` snapshots: every ``every_steps`` steps and/or every
    ``every_seconds`` seconds, whichever comes first. With ``adaptive``, the time interval is
    Young–Daly's ``sqrt(2 × snapshot cost × MTBF)`` from the measured snapshot cost and the
    key's observed preemption rate (its attempts over time), clamped to
    ``[min_seconds, max_seconds]``; ``every_seconds`` is used until both are known."""

    every_steps: int | None = None
    every_seconds: float | None = 600.0
    adaptive: bool = False
    min_seconds: float = 60.0
    max_seconds: float = 3600.0

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ConfigError("every_steps must be at least 1")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ConfigError("every_seconds must be positive")
        if self.every_steps is None and self.every_seconds is None and not self.adaptive:
            raise ConfigError("give every_steps, every_seconds or adaptive=True; otherwise "
                              "nothing is saved")
        if not 0 < self.min_seconds <= self.max_seconds:
            raise ConfigError("need 0 < min_seconds <= max_seconds")


class PersistMode(str, enum.Enum):
    """Where a snapshot is persisted."""

    PROCESS = "process"  # staged in shared memory, persisted by a writer process
    SIDECAR = "process"  # the old name (an alias): "sidecar" now means the pod's container
    INLINE = "inline"  # persisted on the training thread before step() returns

    @classmethod
    def _missing_(cls, value: object) -> PersistMode | None:
        # persist="sidecar", the value before 0.1: the writer process.
        return cls.PROCESS if value == "sidecar" else None


class WhenBusy(str, enum.Enum):
    """What a snapshot does while the previous one is still being persisted."""

    WAIT = "wait"
    SKIP = "skip"
