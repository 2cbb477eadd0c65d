"""The Checkpointer's options: when it snapshots (:class:`SnapshotPolicy`), where a snapshot is
persisted (:class:`PersistMode`) and what a snapshot does while the previous one persists
(:class:`WhenBusy`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime import env, slurm


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


class LrScaling(str, enum.Enum):
    """What a resize from N to M ranks does to the learning rate (``Checkpointer(resize_lr=)``,
    ADR 0052). ``KEEP``: nothing; the script keeps the global batch (per-rank batch or gradient
    accumulation adjusted by ``Checkpointer.resized``). ``LINEAR``: every learning rate times
    M / N, for a script that keeps the per-rank batch, so that the global batch grows by M / N
    (the linear scaling rule, Goyal et al. 2017, for SGD). ``SQRT``: times sqrt(M / N) (the
    square-root rule, often used with Adam)."""

    KEEP = "keep"
    LINEAR = "linear"
    SQRT = "sqrt"


def options_from_env(options: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """``Checkpointer.from_env``'s store, key and options: ``CAIRN_STORE`` and ``CAIRN_KEY``
    (in a SLURM job without ``CAIRN_KEY``, the job's key, :mod:`cairn.runtime.slurm`), and
    ``CAIRN_EVERY_STEPS``, ``CAIRN_EVERY_SECONDS`` and ``CAIRN_EXCLUDE_SEQS`` where
    ``options`` does not set them."""
    store, key = env.STORE.get(), slurm.default_key()
    if not store or not key:
        raise ConfigError(f"{env.STORE} and {env.KEY} must be set (the cairn Airflow operator "
                          "and KFP component set them; a SLURM job names its own key); or "
                          "use Checkpointer(store=..., key=...)")
    options = dict(options)
    env_steps, env_seconds = env.EVERY_STEPS.get(), env.EVERY_SECONDS.get()
    try:
        if env_steps and "every_steps" not in options:
            options["every_steps"] = int(env_steps)
        if env_seconds and "every_seconds" not in options:
            options["every_seconds"] = float(env_seconds)
    except ValueError:
        raise ConfigError(f"{env.EVERY_STEPS} must be an integer and {env.EVERY_SECONDS} a "
                          "number of seconds") from None
    excluded = env.EXCLUDE_SEQS.get()
    if excluded and "exclude_seqs" not in options:
        options["exclude_seqs"] = env.parse_seqs(excluded, source=env.EXCLUDE_SEQS.name)
    return store, key, options
