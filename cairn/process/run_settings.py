"""``cairn run``'s settings (:class:`RunSettings`) and what happens once its command succeeds
(:class:`OnSuccess`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cairn.exceptions import ConfigError
from cairn.process import criu as criu_mod
from cairn.process import restore as restore_mod
from cairn.process import staging as staging_mod
from cairn.runtime import env

DEFAULT_WORKDIR: str = env.WORKDIR.default  # type: ignore[assignment]


class OnSuccess(str, enum.Enum):
    """What happens to the key's snapshots once the command exits 0."""

    DROP = "drop"  # mark the key done and delete its snapshots
    KEEP = "keep"  # leave them (a later run of the same key starts from the last one)


@dataclass(frozen=True)
class RunSettings:
    store: str
    key: str
    argv: tuple[str, ...]
    every_s: float | None = 600.0  # None: no periodic snapshots (only the final one)
    grace_s: float = 30.0
    workdir: str = DEFAULT_WORKDIR
    ghost_limit: int = criu_mod.DEFAULT_GHOST_LIMIT
    on_success: OnSuccess = OnSuccess.DROP
    preflight: bool = True
    echo: bool = True  # copy the workload's output to the supervisor's stdout/stderr
    notice_file: str | None = None  # polled for a sidecar's preemption notice (k8s)
    status_file: str | None = None  # written after each snapshot, for the sidecar's metrics
    exclude_seqs: frozenset[int] = frozenset()  # never restored (a resume policy's verdict)
    allow_rollback: bool = False  # begin older than this machine's committed mark (ADR 0049)
    spool_dir: str | None = None  # hand dumps to `cairn sidecar --upload` here (k8s)
    spool_wait_s: float = 60.0  # at start: wait this long for an earlier run's spooled dumps
    # Where a dump stages without a spool (checked per dump; cairn.process.staging, ADR 0020).
    staging: staging_mod.StagingMedium = staging_mod.StagingMedium.AUTO
    # How a snapshot is restored (cairn.process.restore, ADR 0021).
    restore: restore_mod.RestoreMode = restore_mod.RestoreMode.EAGER
    suspend_poll_s: float = 5.0  # how often the store is read for a suspend request
    # A fresh workload starts with SIGTERM ignored (SLURM signals every process of a job; the
    # supervisor alone answers a SIGTERM, with the final snapshot: cairn.runtime.slurm).
    workload_ignores_sigterm: bool = False

    def __post_init__(self) -> None:
        if not self.argv:
            raise ConfigError("give the command to run after --, e.g. cairn run --store S "
                              "--key K -- python train.py")
        if self.grace_s < 0:
            raise ConfigError("--grace must be zero or more seconds")
        if self.spool_wait_s < 0:
            raise ConfigError("--spool-wait must be zero or more seconds")
        if self.suspend_poll_s <= 0:
            raise ConfigError("--suspend-poll must be a positive duration")
        if not isinstance(self.restore, restore_mod.RestoreMode):
            raise ConfigError(f"restore={self.restore!r}: give a RestoreMode (parse text with "
                              "RestoreMode.parse)")
        if not isinstance(self.staging, staging_mod.StagingMedium):
            raise ConfigError(f"staging={self.staging!r}: give a StagingMedium (parse text with "
                              "StagingMedium.parse)")
