"""A step's history as the policy sees it: its tries' outcome records plus its slot log.

Everything here is derived from what a pod can observe and the store keeps: how each try
ended and on which option, for how long it ran, how far it got, what its snapshots and restore
cost. Estimates are plain statistics (counts, sums, medians) so a decision can be explained in
one line.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cairn.store.outcomes import Outcome, OutcomeKind, TryLog

if TYPE_CHECKING:
    from cairn.store import Key, Store


@dataclass(frozen=True)
class History:
    """Outcome records (oldest first) and the slot log's tries of one step."""

    outcomes: tuple[Outcome, ...] = ()
    tries: tuple[TryLog, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcomes",
                           tuple(sorted(self.outcomes, key=lambda o: o.epoch)))
        object.__setattr__(self, "tries", tuple(self.tries))

    @classmethod
    def from_store(cls, store: Store, key: Key) -> History:
        return cls(tuple(store.records.outcomes(key)), tuple(store.records.tries(key)))

    def with_outcome(self, outcome: Outcome) -> History:
        return History((*self.outcomes, outcome), self.tries)

    def preemptions(self) -> int:
        """Tries that a spot reclaim ended (evictions for maintenance are not counted: those
        are avoided by placement, not by leaving spot)."""
        return sum(o.outcome is OutcomeKind.PREEMPTED for o in self.outcomes)

    def unrecorded_tries(self) -> list[int]:
        """Epochs the slot log shows as ended without ``done`` and without an outcome record
        (a try killed before anyone recorded how: likely a reclaim without notice, but not
        known, so not counted as one)."""
        recorded = {o.epoch for o in self.outcomes}
        return [t.epoch for t in self.tries if t.done_at is None and t.epoch not in recorded]

    def interruptions_on(self, option: str) -> int:
        """Tries on ``option`` ended by the capacity (preempted or evicted)."""
        return sum(o.outcome.interrupted for o in self.outcomes if o.option == option)

    def hours_on(self, option: str) -> float:
        return sum(o.duration_s for o in self.outcomes if o.option == option) / 3600.0

    def snapshot_cost_s(self) -> float | None:
        """The median measured snapshot cost over the tries that measured one."""
        return _median(o.snapshot_cost_s for o in self.outcomes)

    def restore_cost_s(self) -> float | None:
        return _median(o.restore_cost_s for o in self.outcomes)

    def steps_per_hour(self, speeds: Mapping[str, float]) -> float | None:
        """Steps per hour on the reference machine (speed 1.0): steps advanced over hours
        worked, each try's hours scaled by its option's speed (1.0 when unknown)."""
        steps = hours = 0.0
        for o in self.outcomes:
            p = o.progress
            if p.start_step is None or p.end_step is None or o.duration_s <= 0:
                continue
            steps += max(p.end_step - p.start_step, 0)
            work = o.duration_s - (o.restore_cost_s or 0.0)
            hours += max(work, 0.0) / 3600.0 * speeds.get(o.option or "", 1.0)
        return steps / hours if steps > 0 and hours > 0 else None

    def kept_step(self) -> int | None:
        """The step the next try resumes from: the newest of the outcomes' ``kept_step`` and
        the slot log's snapshot steps."""
        points = [(o.ended_at, o.progress.kept_step) for o in self.outcomes
                  if o.progress.kept_step is not None]
        points += [(s.at, s.step) for t in self.tries for s in t.snapshots if s.step is not None]
        return max(points)[1] if points else None

    def total_steps(self) -> int | None:
        for o in reversed(self.outcomes):
            if o.progress.total_steps is not None:
                return o.progress.total_steps
        return None

    def remaining_work_h(self, speeds: Mapping[str, float]) -> float | None:
        """Hours of reference-machine work left: (total - kept) / steps per hour; None when
        the step has not said its length or no try has measured its pace."""
        total, rate = self.total_steps(), self.steps_per_hour(speeds)
        if total is None or rate is None:
            return None
        return max(total - (self.kept_step() or 0), 0) / rate


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
