"""What the parts of one ``cairn run`` share: its paths, the store and attempt, the counters it
reports, the cost of its snapshots, and the host's GPU access (:class:`RunContext`).

The supervisor (:mod:`cairn.process.supervisor`), its child (:mod:`cairn.process.child`), its
dumps (:mod:`cairn.process.dumper`) and its restores (:mod:`cairn.process.restorer`) each hold
the one context of their run. Only the supervisor's (main) thread touches it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import ConfigError
from cairn.process import cuda as cuda_mod
from cairn.process import gpu_map as gpu_map_mod
from cairn.process import gpus as gpus_mod
from cairn.process import snapshot as snap_mod
from cairn.process import staging as staging_mod
from cairn.process.run_settings import RunSettings
from cairn.runtime import channel, env, rollback
from cairn.runtime.units import human_size
from cairn.store import Key, Store
from cairn.store.hashing import digest

log = logging.getLogger("cairn.run")


@dataclass
class DumpCost:
    """What the last snapshot cost, to decide whether a final one fits the grace budget."""

    seconds: float | None = None
    peak_staging_bytes: int = 0
    failures: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class StatusBoard:
    """The run's counters (:class:`cairn.runtime.channel.RunStatus`), published to
    ``status_file`` after each change when one is set (best effort: a failure is said once)."""

    def __init__(self, status_file: str | None) -> None:
        self.status = channel.RunStatus(pid=os.getpid(), started_at=time.time())
        self.path = status_file
        self._failed = False

    def report(self, **changes: Any) -> None:
        self.status = dataclasses.replace(self.status, updated_at=time.time(), **changes)
        if self.path is None:
            return
        try:
            channel.write_status(self.path, self.status)
        except OSError as e:
            if not self._failed:
                log.warning("cannot write the status file %s: %s", self.path, e)
            self._failed = True


class RunContext:
    """One run's shared state (module docstring)."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.key = Key.parse(settings.key)
        self.cwd = os.getcwd()
        # Resolved: CRIU records open files by their real path, which is how logs are matched.
        self.run_dir = os.path.join(os.path.realpath(settings.workdir),
                                    digest(self.key.path.encode())[:16])
        self.stdout_path = os.path.join(self.run_dir, "stdout.log")
        self.stderr_path = os.path.join(self.run_dir, "stderr.log")
        self.staging = os.path.join(self.run_dir, "staging")
        # Where dumps stage when the policy picks memory (made at the first such use).
        self.memory_staging = staging_mod.memory_parent(self.run_dir, self.staging)
        self._memory_hold: int | None = None  # the flock on it while this run stages there
        self._swept = False
        # Where tracked files may live and be restored (the working and run directories and
        # $CAIRN_TRACK_ROOTS): checked before each dump, enforced by each restore.
        self.track_roots = snap_mod.track_roots(log_dir=self.run_dir, cwd=self.cwd)
        self.board = StatusBoard(settings.status_file)
        self.cost = DumpCost()
        self.store: Store | None = None
        self.attempt: Any = None
        # ADR 0049: this machine's record of the newest committed seq, and the oldest seq this
        # try may begin from (None: no check)
        self.mark: rollback.CommittedMark | None = None
        self.rollback_floor: int | None = None
        self.criu: str | None = None
        self.compat: dict[str, Any] = {}
        self._cuda: cuda_mod.CudaCheckpoint | bool | None = None  # False: no driver here
        self.gpu_use: gpus_mod.GpuUse | None = None  # the workload's, at the last dump check
        # Workload run time carried by the snapshots, so a resume can say how much it saved.
        self.runtime_base = 0.0
        self.runtime_since = time.monotonic()

    @property
    def status(self) -> channel.RunStatus:
        return self.board.status

    def runtime_s(self) -> float:
        """The workload's run time so far, across the snapshots it was restored from."""
        return self.runtime_base + (time.monotonic() - self.runtime_since)

    def last_committed_seq(self) -> int | None:
        """The newest snapshot this attempt restored or knows committed."""
        parent = self.attempt.parent.seq if self.attempt.parent is not None else None
        known = [seq for seq in (parent, self.status.last_seq) if seq is not None]
        return max(known) if known else None

    def gpu_map(self) -> dict[str, str]:
        """``CAIRN_GPU_MAP``, parsed (a malformed one raises ConfigError)."""
        return gpu_map_mod.parse_gpu_map(env.GPU_MAP.get())

    def cuda_api(self) -> cuda_mod.CudaCheckpoint | None:
        """The driver's checkpoint API, loaded once; None where libcuda cannot be loaded."""
        if self._cuda is None:
            self._cuda = cuda_mod.CudaCheckpoint.load() or False
        return self._cuda or None

    def sweep_memory_staging(self) -> None:
        """Once per run, before its first staging choice: remove what killed runs of any key
        left staged in RAM (:func:`~cairn.process.staging.remove_abandoned`), so that it
        neither holds memory nor shrinks the headroom the choice is made on."""
        if self._swept:
            return
        self._swept = True
        for path, held in staging_mod.remove_abandoned(keep=self.memory_staging):
            log.warning("removed %s: %s a killed cairn run had staged in memory", path,
                        human_size(held))

    def release_memory_staging(self) -> None:
        """End this run's hold on its memory directory and remove it, with what a killed run
        of this key left there when this one never staged in memory (unless a live run holds
        it). Called once, as the run ends."""
        if self._memory_hold is not None:
            os.close(self._memory_hold)
            self._memory_hold = None
        staging_mod.remove_private_dir(self.memory_staging)

    def usable(self, choice: staging_mod.StagingChoice, *, strict: bool,
               instead: str) -> staging_mod.StagingChoice:
        """``choice`` with its parent made: the memory directory is held and prepared once per
        run (a killed run's leftovers go); where it cannot be, the disk instead (logged with
        ``instead``), or, when ``strict``, the ConfigError."""
        if choice.parent == self.memory_staging and self._memory_hold is None:
            try:
                self._memory_hold = staging_mod.hold_private_dir(choice.parent)
            except ConfigError as e:
                if strict:
                    raise
                log.warning("%s; %s", e, instead)
                choice = dataclasses.replace(choice, parent=self.staging,
                                             medium=staging_mod.StagingMedium.DISK)
        os.makedirs(choice.parent, exist_ok=True)
        return choice
