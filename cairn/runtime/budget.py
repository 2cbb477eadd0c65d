"""The final-snapshot budget: how long a snapshot taken on a preemption notice may take.

A notice (SIGTERM, SIGUSR1, a sidecar's notice file) starts a countdown of ``seconds`` — the
smaller of the platform's notice (GKE spot: about 15 s; Airflow's UI kill: 5 s) and the
termination grace — also bounded by the notice's own deadline when it carries one. A final
snapshot is taken only when its estimated cost fits what is left; otherwise the periodic
snapshots carry the step. Both modes decide with this: ``cairn run`` (process) and the
Checkpointer's preemption handler (state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cairn.exceptions import ConfigError

# A conservative throughput for a first final dump when no snapshot was measured yet.
UNMEASURED_BYTES_PER_S = 100e6


@dataclass(frozen=True)
class FinalBudget:
    """``seconds`` from the notice at ``started`` (``time.monotonic()``), and no later than
    ``deadline`` (Unix seconds) when the notice named one."""

    seconds: float
    started: float
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ConfigError("a final-snapshot budget must be zero or more seconds")

    def remaining(self, *, monotonic: float | None = None, wall: float | None = None) -> float:
        """Seconds left (negative once it ran out)."""
        now = time.monotonic() if monotonic is None else monotonic
        left = self.seconds - (now - self.started)
        if self.deadline is not None:
            left = min(left, self.deadline - (time.time() if wall is None else wall))
        return left

    def fits(self, estimate_s: float, **now: float) -> bool:
        """Whether a snapshot estimated to take ``estimate_s`` fits what is left."""
        return estimate_s <= self.remaining(**now)


def estimate_unmeasured(resident_bytes: int) -> float:
    """What a first snapshot of ``resident_bytes`` may cost, before any was measured."""
    return resident_bytes / UNMEASURED_BYTES_PER_S
