"""What the snapshots page shows for one key, read from a cairn store (no Airflow here).

:func:`build_report` reads the key's slot log once (``Store.history``) and derives:

- the retained snapshots (after the last ``done``) with size, bytes written, dedup ratio and a
  verify status: ``present`` (manifest reads and every pack is there; cheap) or, with
  ``deep=True``, ``verified`` / ``corrupt`` from reading every chunk (``Store.verify``);
- one row per attempt (each ``open`` record is a try's epoch): what it resumed from, how many
  steps it did not redo, what it did (snapshots, last step, bytes, stalls: the try's summary,
  which survives retention, docs/adr/0031), how it ended as far as the log tells, and the
  outcome record when the store keeps them;
- the progress points (time, step) for the chart, and the measured seconds per step, which
  turns "steps not redone" into "time saved".

Snapshot step semantics follow ``Checkpointer.step``: a snapshot at step ``s`` holds the state
after step ``s``, so a resume from it skips ``s + 1`` steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from cairn.exceptions import CorruptSnapshot, StoreError
from cairn.store import Key, Record, RecordKind, Store, parse_timestamp, try_summaries


@dataclass(frozen=True)
class SnapshotRow:
    """One retained snapshot. ``dedup_ratio``: logical bytes per byte written (None when
    nothing was written: everything was deduplicated)."""

    seq: int
    epoch: int
    step: int | None
    created_at: str
    mode: str
    bytes_logical: int
    bytes_written: int
    dedup_ratio: float | None
    chunks: int | None
    chunks_reused: int | None
    status: str  # "present", "verified", "missing", "corrupt"
    reason: str | None = None


@dataclass(frozen=True)
class AirflowTry:
    """One Airflow try of the task instance, as the metadata DB has it (given by the caller)."""

    try_number: int
    state: str | None
    start_date: datetime | None
    end_date: datetime | None


@dataclass(frozen=True)
class TryRow:
    """One attempt (an ``open`` record; its seq is the epoch).

    ``resumed_step``: the step of the snapshot it resumed from (None: fresh start, or that
    snapshot was pruned and the open record does not say); ``steps_saved``: steps it did not
    redo; ``seconds_saved``: those steps times the measured seconds per step.
    """

    epoch: int
    opened_at: str
    mode: str | None
    resumed_from: int | None
    resumed_step: int | None
    steps_saved: int | None
    seconds_saved: float | None
    snapshots: int
    last_step: int | None
    ended: str  # "succeeded", "removed", "followed by epoch N", "no done record"
    outcome: str | None = None
    # From the try's summary (cairn.store.outcomes.TrySummary; kept through retention):
    # new bytes its snapshots wrote, the time they kept it waiting (None: not known).
    bytes_written: int | None = None
    stall_s: float | None = None
    airflow_try: int | None = None
    airflow_state: str | None = None


@dataclass(frozen=True)
class Point:
    """A committed snapshot on the progress chart (``t``: seconds since the first record)."""

    t: float
    step: int
    epoch: int
    seq: int


@dataclass(frozen=True)
class Resume:
    """A try that resumed: it opened at ``t`` and continued after ``step``."""

    t: float
    step: int
    epoch: int
    from_seq: int


@dataclass(frozen=True)
class TaskReport:
    key: str
    store: str
    state: str  # "no records", "active", "done"
    snapshots: tuple[SnapshotRow, ...] = ()
    tries: tuple[TryRow, ...] = ()
    points: tuple[Point, ...] = ()
    resumes: tuple[Resume, ...] = ()
    started_at: str | None = None
    seconds_per_step: float | None = None
    steps_saved: int = 0
    seconds_saved: float | None = None
    deep_verified: bool = False
    outcomes_available: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The key's suspension that still matters (Suspension.to_json(): state, who asked, when,
    # why, the resume), None when it has none.
    suspension: dict[str, Any] | None = None
    running: bool = False  # the newest try has no outcome record yet: it can be suspended
    # The capacity options a resume may move the suspended step to (its try recorded them:
    # a pod-based step with placement=); empty for a step that cannot be moved.
    move_options: tuple[str, ...] = ()

    @property
    def held(self) -> bool:
        """Suspended (or asked to be) and not resumed: the page offers a resume."""
        return self.suspension is not None and self.suspension.get("resumed_by") is None

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def _since_last_done(records: Sequence[Record]) -> tuple[list[Record], bool]:
    """The records of the current cycle: after the last ``done`` that is not the tail, or all
    of them. A ``done`` at the tail ends the cycle it closes, which is still shown."""
    done_at = [i for i, r in enumerate(records) if r.kind is RecordKind.DONE]
    if not done_at:
        return list(records), False
    if done_at[-1] == len(records) - 1:
        start = done_at[-2] + 1 if len(done_at) > 1 else 0
        return list(records[start:]), True
    return list(records[done_at[-1] + 1:]), False


def _seconds_per_step(snaps: Sequence[Record]) -> float | None:
    """The median of time/steps between consecutive snapshots of the same attempt."""
    rates = []
    for a, b in zip(snaps, snaps[1:]):
        if a.epoch != b.epoch or a.manifest is None or b.manifest is None:
            continue
        if a.manifest.step is None or b.manifest.step is None or b.manifest.step <= a.manifest.step:
            continue
        dt = parse_timestamp(b.created_at) - parse_timestamp(a.created_at)
        if dt > 0:
            rates.append(dt / (b.manifest.step - a.manifest.step))
    return statistics.median(rates) if rates else None


def _snapshot_rows(store: Store, key: Key, snaps: Sequence[Record], *,
                   deep: bool) -> list[SnapshotRow]:
    verdicts: dict[int, str | None] = {}
    if deep:
        verdicts = dict(store.verify(key).results)
    rows = []
    for record in sorted(snaps, key=lambda r: r.seq, reverse=True):
        manifest = record.manifest
        assert manifest is not None
        if deep:
            reason = verdicts.get(record.seq)
            status = "corrupt" if reason else "verified"
        else:
            try:
                store.check_present(manifest)
                status, reason = "present", None
            except CorruptSnapshot as e:
                status, reason = "missing", str(e)
        meta = manifest.metadata
        written = manifest.bytes_written
        rows.append(SnapshotRow(
            seq=record.seq, epoch=record.epoch, step=manifest.step,
            created_at=record.created_at, mode=manifest.mode.value,
            bytes_logical=manifest.bytes_logical, bytes_written=written,
            dedup_ratio=(manifest.bytes_logical / written) if written else None,
            chunks=meta.get("chunks"), chunks_reused=meta.get("chunks_reused"),
            status=status, reason=reason))
    return rows


def _match_try(opened: float, tries: Sequence[AirflowTry]) -> AirflowTry | None:
    """The Airflow try whose run time holds the moment the attempt opened (seconds since the
    Unix epoch)."""
    now = datetime.now(timezone.utc)
    for t in sorted(tries, key=lambda t: t.try_number, reverse=True):
        if t.start_date is None:
            continue
        end = t.end_date or now
        if t.start_date.timestamp() <= opened <= end.timestamp():
            return t
    return None


def describe_outcome(outcome: Any) -> str:
    """One line for an outcome record (:class:`cairn.store.outcomes.Outcome`)."""
    kind = getattr(outcome.outcome, "value", outcome.outcome)
    progress = getattr(outcome, "progress", None)
    end = getattr(progress, "end_step", None)
    parts = [str(kind)]
    if end is not None:
        parts.append(f"at step {end}")
    if getattr(outcome, "reason", None):
        parts.append(f"({outcome.reason})")
    return " ".join(parts)


def build_report(store: Store, key: Key, *, deep: bool = False,
                 airflow_tries: Iterable[AirflowTry] = (),
                 outcomes: Iterable[Any] | None = None) -> TaskReport:
    """The report for ``key`` (see the module docstring). ``outcomes``: the key's outcome
    records (``Store.records.outcomes``; None when the store has none); an outcome's
    ``progress.start_step`` gives the resumed step when retention removed that snapshot.
    ``airflow_tries`` lets each attempt name the Airflow try it ran in."""
    records = store.history(key)
    if not records:
        return TaskReport(key=str(key), store=store.url, state="no records")
    cycle, done = _since_last_done(records)
    tries_list = list(airflow_tries)
    by_epoch = {o.epoch: o for o in outcomes} if outcomes is not None else {}
    snaps = [r for r in cycle if r.kind is RecordKind.SNAP and r.manifest is not None]
    opens = [r for r in cycle if r.kind is RecordKind.OPEN]
    summaries = try_summaries(records, by_epoch.values())
    per_step = _seconds_per_step(snaps)
    if per_step is None:  # the snapshots are gone (done, retention): the tries measured it
        paces = [v.seconds_per_step for v in summaries.values()
                 if v.seconds_per_step is not None]
        per_step = statistics.median(paces) if paces else None
    step_of = {r.seq: r.manifest.step for r in snaps if r.manifest is not None}
    origin = parse_timestamp((cycle or records)[0].created_at)
    notes: list[str] = []

    tries: list[TryRow] = []
    resumes: list[Resume] = []
    total_saved = 0
    for i, rec in enumerate(opens):
        note = rec.body.get("note") or {}
        # Bookkeeping attempts (a discard, the operator marking a key done for a subprocess)
        # ran no work: they resumed nothing.
        bookkeeping = (note.get("purpose") == "remove"
                       or note.get("mode") in ("finish", "airflow-finish"))  # older stores
        resumed_from = None if bookkeeping else note.get("resumed_from")
        outcome = by_epoch.get(rec.seq)
        resumed_step = note.get("resumed_step", step_of.get(resumed_from))
        if resumed_step is None and resumed_from is not None and outcome is not None:
            resumed_step = getattr(outcome.progress, "start_step", None)
        steps_saved = resumed_step + 1 if isinstance(resumed_step, int) else None
        summary = summaries.get(rec.seq)
        ending = [r for r in cycle if r.kind is RecordKind.DONE and r.epoch == rec.seq]
        if ending:
            ended = "removed" if ending[0].body.get("reason") == "removed" else "succeeded"
        elif i + 1 < len(opens):
            ended = f"followed by epoch {opens[i + 1].seq}"
        else:
            ended = "no done record"
        opened = parse_timestamp(rec.created_at)
        matched = _match_try(opened, tries_list)
        if resumed_from is not None and resumed_step is None:
            notes.append(f"epoch {rec.seq} resumed from seq {resumed_from}, which retention "
                         "has removed; its step is unknown")
        if isinstance(resumed_step, int):
            total_saved += resumed_step + 1
            resumes.append(Resume(t=opened - origin, step=resumed_step,
                                  epoch=rec.seq, from_seq=int(resumed_from)))
        tries.append(TryRow(
            epoch=rec.seq, opened_at=rec.created_at,
            mode="discard" if note.get("purpose") == "remove" else note.get("mode"),
            resumed_from=resumed_from, resumed_step=resumed_step, steps_saved=steps_saved,
            seconds_saved=(steps_saved * per_step
                           if steps_saved is not None and per_step is not None else None),
            snapshots=summary.snapshots if summary is not None else 0,
            last_step=summary.last_step if summary is not None else None,
            ended=ended,
            outcome=describe_outcome(outcome) if outcome is not None else None,
            bytes_written=summary.bytes_written if summary is not None else None,
            stall_s=summary.stall_s if summary is not None else None,
            airflow_try=matched.try_number if matched else None,
            airflow_state=matched.state if matched else None))

    points = tuple(Point(t=parse_timestamp(r.created_at) - origin,
                         step=r.manifest.step, epoch=r.epoch, seq=r.seq)
                   for r in snaps if r.manifest is not None and r.manifest.step is not None)
    if done:
        notes.append("the task succeeded: its snapshots were removed (keep_snapshots=True keeps "
                     "them); the attempts below are what the log still holds")
    try:
        rows = _snapshot_rows(store, key, snaps, deep=deep)
    except StoreError as e:
        rows = []
        notes.append(f"could not check the snapshots: {e}")
    suspended = _suspension(store, key, notes)
    last = tries[-1] if tries else None
    running = (not done and last is not None and last.outcome is None
               and outcomes is not None and last.ended == "no done record")
    stopped = by_epoch.get(suspended["epoch"]) if suspended is not None else None
    movable = (stopped.options if stopped is not None and suspended is not None
               and suspended.get("resumed_by") is None else ())
    return TaskReport(
        suspension=suspended, running=running, move_options=tuple(movable),
        key=str(key), store=store.url, state="done" if done else "active",
        snapshots=tuple(rows), tries=tuple(tries), points=points, resumes=tuple(resumes),
        started_at=cycle[0].created_at if cycle else None, seconds_per_step=per_step,
        steps_saved=total_saved,
        seconds_saved=total_saved * per_step if per_step is not None else None,
        deep_verified=deep, outcomes_available=outcomes is not None, notes=tuple(notes))


def _suspension(store: Store, key: Key, notes: list[str]) -> dict[str, Any] | None:
    """The key's suspension as JSON (None: none, or this cairn has no requests)."""
    reader = getattr(getattr(store, "records", None), "suspension", None)
    if reader is None:
        return None
    try:
        current = reader(key)
    except StoreError as e:
        notes.append(f"could not read the suspend requests: {e}")
        return None
    return None if current is None else current.to_json()
