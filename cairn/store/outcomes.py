"""Outcome records: how each try (attempt epoch) of a key ended, and where it ran.

The slot log says what was *committed*; an outcome says what *happened* to a try: succeeded,
preempted, failed..., on which capacity option (and which options it could have run on), how
far it got, what its snapshots and restore cost, the placement reason it was started with, and
what it did (:class:`TrySummary`: snapshots, last step, bytes, stalls), which outlives the
snapshot records retention deletes (:func:`try_summaries`, docs/adr/0031). :mod:`cairn.policy`
reads them to place the next try; a UI shows them.

Records live at ``keys/<key path>/@outcomes/<epoch:020d>.json``, one per epoch, create-only
(a second record for the same epoch is :class:`~cairn.exceptions.AlreadyExists`): the try's
own process, or the orchestrator that saw it end, writes it once. They are small and outside the
slot log, so they neither fence nor are fenced, and retention and GC leave them alone. A record
that cannot be read (corrupt, or a newer schema) is skipped with a warning, never fatal: outcomes
are advice, not state.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import ConfigError
from cairn.store.slotlog import (
    KEYS_PREFIX,
    Record,
    RecordKind,
    seq_from_name,
    writer_identity,
)
from cairn.store.timestamps import format_timestamp, parse_timestamp

log = logging.getLogger(__name__)

OUTCOME_SCHEMA = "cairn.outcome/1"
OUTCOMES_DIR = "@outcomes"


class OutcomeKind(str, enum.Enum):
    """How a try ended. ``preempted`` and ``evicted`` are the capacity's doing (a spot reclaim;
    a drain for maintenance or an upgrade), the rest the step's or the orchestrator's."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"          # the step's own error (exit code, exception)
    PREEMPTED = "preempted"    # spot / preemptible capacity reclaimed
    EVICTED = "evicted"        # node drained: maintenance, upgrade, scale-down
    FENCED = "fenced"          # a newer try took the key over
    KILLED = "killed"          # stopped by a person or a timeout
    SUSPENDED = "suspended"    # stopped on request with a final snapshot, to resume later

    @property
    def interrupted(self) -> bool:
        """The capacity, not the step, ended the try."""
        return self in (OutcomeKind.PREEMPTED, OutcomeKind.EVICTED)


@dataclass(frozen=True)
class Progress:
    """How far a try got, in the step's own units (training steps, say).

    ``start_step``: where the try began (the restored snapshot's step, 0 when fresh);
    ``end_step``: where it was when it ended; ``kept_step``: the step of the last snapshot
    committed by the end (what the next try resumes from); ``total_steps`` when the step knows
    its length; ``snapshot_seq``: the seq of that last snapshot.
    """

    start_step: int | None = None
    end_step: int | None = None
    kept_step: int | None = None
    total_steps: int | None = None
    snapshot_seq: int | None = None

    def __post_init__(self) -> None:
        for name in ("start_step", "end_step", "kept_step", "total_steps", "snapshot_seq"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise ConfigError(f"progress.{name} must be a non-negative integer or None, "
                                  f"got {value!r}")


@dataclass(frozen=True)
class TrySummary:
    """What one try did, kept where retention and GC do not reach (docs/adr/0031).

    ``snapshots``: snapshots it committed; ``last_step`` / ``last_seq``: its newest one's step
    and seq; ``bytes_logical``: that snapshot's size; ``bytes_written``: the new bytes its
    snapshots wrote; ``stall_s``: the total time its snapshots kept the workload waiting;
    ``seconds_per_step``: its measured pace (what turns steps not redone into time saved).
    ``complete``: every figure covers every snapshot (False when some were already pruned from
    the log and ``bytes_written`` counts only the rest). None: not known.
    """

    snapshots: int = 0
    last_step: int | None = None
    last_seq: int | None = None
    bytes_logical: int | None = None
    bytes_written: int | None = None
    stall_s: float | None = None
    seconds_per_step: float | None = None
    complete: bool = True

    def __post_init__(self) -> None:
        for name in ("snapshots", "last_step", "last_seq", "bytes_logical", "bytes_written"):
            value = getattr(self, name)
            if (value is None and name != "snapshots") or (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                continue
            raise ConfigError(f"try summary {name} must be a non-negative integer, got {value!r}")
        for name in ("stall_s", "seconds_per_step"):
            value = getattr(self, name)
            if value is not None and (not _finite(value) or value < 0):
                raise ConfigError(f"try summary {name} must be a non-negative number of seconds "
                                  f"or None, got {value!r}")
        if not isinstance(self.complete, bool):
            raise ConfigError("try summary complete must be true or false")

    def to_json(self) -> dict[str, Any]:
        return {"snapshots": self.snapshots, "last_step": self.last_step,
                "last_seq": self.last_seq, "bytes_logical": self.bytes_logical,
                "bytes_written": self.bytes_written, "stall_s": self.stall_s,
                "seconds_per_step": self.seconds_per_step, "complete": self.complete}

    @classmethod
    def from_json(cls, doc: object) -> TrySummary:
        """Parse one (ValueError naming what is wrong); unknown fields are ignored, so a newer
        cairn's summary still reads."""
        if not isinstance(doc, Mapping):
            raise ValueError("a try summary must be a JSON object")
        try:
            return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})
        except ConfigError as e:
            raise ValueError(str(e)) from None


@dataclass(frozen=True)
class Outcome:
    """One try's outcome. Times are seconds since the Unix epoch; costs are seconds.

    ``snapshot_cost_s``: the measured time a snapshot stalled or took (the median of the try's,
    say); ``restore_cost_s``: the time the try spent restoring before it could work.
    ``frozen_s`` / ``gpu_stall_s``: a process-mode try's total of CRIU's frozen time and of its
    GPU stall (CUDA lock -> unlock) over its snapshots, None when not measured.
    ``option``: the name of the capacity option the try ran on; ``reason``: the one-line reason
    of the placement decision that put it there; ``options``: the names of every capacity
    option the step could have been placed on (what a resume may move it to; empty for a step
    that cannot be moved). ``summary``: what the try did (:class:`TrySummary`; None in records
    written before cairn kept it). ``detail``: free-form JSON.
    """

    epoch: int
    outcome: OutcomeKind
    started_at: float
    ended_at: float
    progress: Progress = field(default_factory=Progress)
    snapshot_cost_s: float | None = None
    restore_cost_s: float | None = None
    frozen_s: float | None = None
    gpu_stall_s: float | None = None
    option: str | None = None
    reason: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    summary: TrySummary | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 1:
            raise ConfigError(f"outcome epoch must be a slot-log epoch (an integer >= 1), "
                              f"got {self.epoch!r}")
        if not isinstance(self.outcome, OutcomeKind):
            try:
                object.__setattr__(self, "outcome", OutcomeKind(self.outcome))
            except ValueError:
                kinds = ", ".join(k.value for k in OutcomeKind)
                raise ConfigError(f"unknown outcome {self.outcome!r}; use one of {kinds}") from None
        for name in ("started_at", "ended_at"):
            if not _finite(getattr(self, name)):
                raise ConfigError(f"outcome {name} must be a finite number of seconds since "
                                  "the epoch")
        if self.ended_at < self.started_at:
            raise ConfigError("outcome ended_at is before started_at; swap them or fix the clock")
        for name in ("snapshot_cost_s", "restore_cost_s", "frozen_s", "gpu_stall_s"):
            value = getattr(self, name)
            if value is not None and (not _finite(value) or value < 0):
                raise ConfigError(f"outcome {name} must be a non-negative number of seconds or "
                                  f"None, got {value!r}")
        if self.option is not None and (not isinstance(self.option, str) or not self.option):
            raise ConfigError("outcome option must be a capacity option's name or None")
        if self.reason is not None and ("\n" in self.reason or "\r" in self.reason):
            raise ConfigError("outcome reason must be one line; put the rest in detail")
        if isinstance(self.options, str):
            raise ConfigError("outcome options is a list of capacity option names")
        object.__setattr__(self, "options", tuple(self.options))
        if any(not isinstance(o, str) or not o for o in self.options):
            raise ConfigError("outcome options must be capacity option names")
        if self.summary is not None and not isinstance(self.summary, TrySummary):
            raise ConfigError("outcome summary must be a TrySummary or None")
        try:
            json.dumps(dict(self.detail), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"outcome detail must be plain JSON data: {e}") from None

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at

    def to_json(self) -> dict[str, Any]:
        p = self.progress
        return {
            "schema": OUTCOME_SCHEMA,
            "epoch": self.epoch,
            "outcome": self.outcome.value,
            "started_at": format_timestamp(self.started_at),
            "ended_at": format_timestamp(self.ended_at),
            "progress": {"start_step": p.start_step, "end_step": p.end_step,
                         "kept_step": p.kept_step, "total_steps": p.total_steps,
                         "snapshot_seq": p.snapshot_seq},
            "snapshot_cost_s": self.snapshot_cost_s,
            "restore_cost_s": self.restore_cost_s,
            "frozen_s": self.frozen_s,
            "gpu_stall_s": self.gpu_stall_s,
            "option": self.option,
            "reason": self.reason,
            "options": list(self.options),
            "summary": self.summary.to_json() if self.summary is not None else None,
            "detail": dict(self.detail),
        }


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def outcomes_prefix(key_path: str) -> str:
    return f"{KEYS_PREFIX}{key_path}/{OUTCOMES_DIR}/"


def outcome_name(key_path: str, epoch: int) -> str:
    return f"{outcomes_prefix(key_path)}{epoch:020d}.json"


def record_bytes(doc: Mapping[str, Any], *, key: tuple[str, ...]) -> bytes:
    """A record beside the slot log (an outcome, a request) as stored: ``doc`` with the key,
    when and by whom it was written."""
    full = {**doc, "key": list(key), "created_at": format_timestamp(), "writer": writer_identity()}
    return json.dumps(full, separators=(",", ":"), allow_nan=False).encode("utf-8")


def load_record(data: bytes, *, schema: str, what: str) -> dict[str, Any]:
    """The JSON object of a record beside the slot log, checked to be of ``schema`` (JSON
    only: nothing read is executed). Raises ValueError naming what is wrong."""
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("schema") != schema:
        raise ValueError(f"unknown {what} schema {doc.get('schema')!r} (this cairn reads "
                         f"{schema}); upgrade cairn to read it")
    return doc


def encode_outcome(outcome: Outcome, *, key: tuple[str, ...]) -> bytes:
    return record_bytes(outcome.to_json(), key=key)


def decode_outcome(data: bytes, *, epoch: int) -> Outcome:
    """Parse one record stored at ``epoch``. Raises ValueError naming what is wrong."""
    try:
        doc = load_record(data, schema=OUTCOME_SCHEMA, what="outcome")
        if doc.get("epoch") != epoch:
            raise ValueError(f"record says epoch {doc.get('epoch')!r} but is stored at {epoch}")
        p = doc.get("progress") or {}
        return Outcome(
            epoch=epoch,
            outcome=OutcomeKind(doc["outcome"]),
            started_at=parse_timestamp(doc["started_at"]),
            ended_at=parse_timestamp(doc["ended_at"]),
            progress=Progress(**{k: p.get(k) for k in ("start_step", "end_step", "kept_step",
                                                         "total_steps", "snapshot_seq")}),
            snapshot_cost_s=doc.get("snapshot_cost_s"),
            restore_cost_s=doc.get("restore_cost_s"),
            frozen_s=doc.get("frozen_s"),
            gpu_stall_s=doc.get("gpu_stall_s"),
            option=doc.get("option"),
            reason=doc.get("reason"),
            detail=doc.get("detail") or {},
            options=tuple(doc.get("options") or ()),
            summary=_summary_or_none(doc.get("summary"), epoch),
        )
    except (KeyError, TypeError, AttributeError, ConfigError) as e:
        raise ValueError(f"malformed outcome record: {e}") from None


def _summary_or_none(doc: object, epoch: int) -> TrySummary | None:
    """A record's summary; one that does not parse is dropped with a warning, keeping the
    outcome itself (what the policies read)."""
    if doc is None:
        return None
    try:
        return TrySummary.from_json(doc)
    except ValueError as e:
        log.warning("outcome of try %d: ignoring its unreadable summary: %s", epoch, e)
        return None


def epoch_from_name(name: str) -> int | None:
    return seq_from_name(name)


# -- what the slot log already tells about each try ------------------------------------------


@dataclass(frozen=True)
class SnapPoint:
    """A committed snapshot as the log still lists it (retention prunes old ones)."""

    seq: int
    at: float
    step: int | None


@dataclass(frozen=True)
class TryLog:
    """One try as the slot log records it: when it opened, the snapshots it committed that
    retention kept, whether it ended the key (``done``), and the seq it resumed from."""

    epoch: int
    opened_at: float
    snapshots: tuple[SnapPoint, ...] = ()
    done_at: float | None = None
    resumed_from: int | None = None


def tries_from_records(records: list[Record]) -> list[TryLog]:
    """Group slot-log records by epoch, oldest first. Records with unreadable timestamps are
    left out (with a warning) rather than failing the whole history."""
    opened: dict[int, dict[str, Any]] = {}
    for record in records:
        try:
            at = parse_timestamp(record.created_at)
        except ValueError:
            log.warning("key %s: seq %d has an unreadable timestamp %r; left out of the history",
                        "/".join(record.key), record.seq, record.created_at)
            continue
        if record.kind is RecordKind.OPEN:
            note = record.body.get("note") or {}
            resumed = note.get("resumed_from") if isinstance(note, dict) else None
            opened[record.epoch] = {"epoch": record.epoch, "opened_at": at, "snapshots": [],
                                    "done_at": None,
                                    "resumed_from": resumed if isinstance(resumed, int) else None}
            continue
        entry = opened.get(record.epoch)
        if entry is None:
            continue  # its open record is unreadable
        if record.kind is RecordKind.SNAP and record.manifest is not None:
            entry["snapshots"].append(SnapPoint(record.seq, at, record.manifest.step))
        elif record.kind is RecordKind.DONE:
            entry["done_at"] = at
    return [TryLog(**{**e, "snapshots": tuple(e["snapshots"])})
            for _, e in sorted(opened.items())]


# -- what each try did, kept through retention (docs/adr/0031) -------------------------------

PREVIOUS_NOTE = "previous"  # the open-record note that carries the previous try's summary


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def summarize_log(records: Sequence[Record], epoch: int, *,
                  end_seq: int | None = None) -> TrySummary:
    """Try ``epoch``'s summary as the slot log shows it now. ``end_seq``: the seq after its
    records (default: the next try's ``open`` in ``records``, else the log's end).

    The count is exact even after retention or a ``done`` removed snapshot records: an
    attempt only ever creates its own last seq + 1 and the newest seq is never deleted, so
    every seq from ``epoch`` up to the next try's ``open`` was this try's ``open``, its
    snapshots and, last, its ``done``. Step, bytes and pace come from the snapshots still
    listed (``complete`` says whether that is all of them); stalls are not in the log.
    """
    if end_seq is None:
        end_seq = min((r.seq for r in records if r.kind is RecordKind.OPEN and r.seq > epoch),
                      default=None)
    own = [r for r in records if r.epoch == epoch]
    done = any(r.kind is RecordKind.DONE for r in own)
    snaps = sorted((r for r in own if r.kind is RecordKind.SNAP and r.manifest is not None),
                   key=lambda r: r.seq)
    last_seq_seen = max((r.seq for r in own), default=epoch)
    end = end_seq if end_seq is not None else last_seq_seen + 1
    count = max(end - epoch - 1 - int(done), len(snaps))
    newest = snaps[-1].manifest if snaps else None
    steps = [(parse_timestamp(r.created_at), r.manifest.step) for r in snaps
             if r.manifest is not None and r.manifest.step is not None]
    rates = [(t2 - t1) / (s2 - s1) for (t1, s1), (t2, s2) in zip(steps, steps[1:])
             if s2 > s1 and t2 > t1]
    return TrySummary(
        snapshots=count,
        last_step=newest.step if newest is not None else None,
        last_seq=newest.seq if newest is not None else None,
        bytes_logical=newest.bytes_logical if newest is not None else None,
        bytes_written=sum(r.manifest.bytes_written for r in snaps if r.manifest is not None)
        if snaps else (0 if count == 0 else None),
        seconds_per_step=_median(rates),
        complete=len(snaps) == count)


def previous_summary(records_newest_first: Iterable[Record]) -> dict[str, Any] | None:
    """The note a new try's ``open`` record carries about the try before it (None when the
    key has none or the key is done): read newest first up to that try's ``open``."""
    seen: list[Record] = []
    for record in records_newest_first:
        if record.kind is RecordKind.DONE and not seen:
            return None  # the key is done: the next try starts a new cycle
        seen.append(record)
        if record.kind is RecordKind.OPEN:
            break
    if not seen or seen[-1].kind is not RecordKind.OPEN:
        return None
    summary = summarize_log(seen, seen[-1].epoch)
    return {"epoch": seen[-1].epoch, **summary.to_json()}


def try_summaries(records: Sequence[Record],
                  outcomes: Iterable[Outcome] = ()) -> dict[int, TrySummary]:
    """Each try's summary, by epoch: the try's own (its outcome record), else what the next
    try's ``open`` noted about it (a try killed before it could record one), else the slot
    log as it is now. The count always comes from the log's seqs (exact, see
    :func:`summarize_log`); a try that left only its count gets its last step from the next
    try's ``open`` when that try resumed from it."""
    opens = sorted((r for r in records if r.kind is RecordKind.OPEN), key=lambda r: r.seq)
    by_outcome = {o.epoch: o.summary for o in outcomes if o.summary is not None}
    out: dict[int, TrySummary] = {}
    for index, record in enumerate(opens):
        nxt = opens[index + 1] if index + 1 < len(opens) else None
        live = summarize_log(records, record.seq)
        own = by_outcome.get(record.seq)
        if own is not None:
            out[record.seq] = own
            continue
        note = (nxt.body.get("note") or {}) if nxt is not None else {}
        noted = note.get(PREVIOUS_NOTE) if isinstance(note, dict) else None
        if isinstance(noted, dict) and noted.get("epoch") == record.seq:
            try:
                kept = TrySummary.from_json(noted)
            except ValueError as e:
                log.warning("key %s: epoch %d's note about epoch %d is unreadable: %s",
                            "/".join(record.key), nxt.seq if nxt else 0, record.seq, e)
            else:  # the log, while it still holds every snapshot, is as good
                out[record.seq] = live if live.complete else kept
                continue
        resumed = note.get("resumed_from") if isinstance(note, dict) else None
        if (live.last_seq is None and isinstance(resumed, int)
                and record.seq < resumed < (nxt.seq if nxt else resumed + 1)):
            step = note.get("resumed_step")
            live = dataclasses.replace(live, last_seq=resumed,
                                       last_step=step if isinstance(step, int) else None)
        out[record.seq] = live
    return out
