"""Suspend and resume requests: an operator's asks to a key's try, kept beside the slot log.

An operator who needs a step's GPUs back asks for it to be *suspended*: its running try takes
a final snapshot and stops (outcome ``suspended``), and no new try of the key starts until a
*resume* is asked for; the next try then resumes from the suspend snapshot.

Records live at ``keys/<key path>/@requests/<epoch:020d>.<kind>.json``, create-only, at most
one ``suspend`` and one ``resume`` per target epoch (the try asked to stop). Like outcome
records they are outside the slot log: they never take a seq, never fence the running try
(which must still commit its final snapshot) and retention and GC leave them alone. A second
ask of the same kind for the same epoch finds the first and changes nothing. A record that
cannot be read is skipped with a warning.

Which try a suspend targets and whether a resume is allowed is decided here, from the slot
log's tries and the outcome records (:func:`suspend_target`, :func:`resume_target`); the
:class:`~cairn.store.store.Store` only reads and creates the records.
"""

from __future__ import annotations

import enum
import getpass
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cairn.exceptions import ConfigError, NotFound
from cairn.store.outcomes import (
    Outcome,
    OutcomeKind,
    TryLog,
    load_record,
    record_bytes,
)
from cairn.store.slotlog import KEYS_PREFIX
from cairn.store.timestamps import format_timestamp, parse_timestamp

REQUEST_SCHEMA = "cairn.request/1"
REQUESTS_DIR = "@requests"
MAX_TEXT = 500  # reasons and requesters are shown in one line of a listing


class RequestKind(str, enum.Enum):
    """What an operator may ask of a key's try: stop it with a final snapshot (``suspend``),
    or lift that suspension (``resume``). Its values name the request records and the routes
    and commands that make them."""

    SUSPEND = "suspend"
    RESUME = "resume"


@dataclass(frozen=True)
class Request:
    """One ask: ``kind`` for try ``epoch``, made by ``by`` at ``at`` (seconds since the Unix
    epoch), with an optional one-line ``reason``; a resume may name a ``placement`` (a
    capacity option of :mod:`cairn.policy`) to move the step to."""

    kind: RequestKind
    epoch: int
    by: str
    at: float
    reason: str | None = None
    placement: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", RequestKind(self.kind))
        except ValueError:
            raise ConfigError(f"unknown request kind {self.kind!r}; use suspend or "
                              "resume") from None
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 1:
            raise ConfigError(f"a request's epoch must be a slot-log epoch (an integer >= 1), "
                              f"got {self.epoch!r}")
        _check_line("by", self.by, required=True)
        _check_line("reason", self.reason)
        _check_line("placement", self.placement)
        if self.placement is not None and self.kind is not RequestKind.RESUME:
            raise ConfigError("only a resume request names a placement")

    def to_json(self) -> dict[str, object]:
        return {"schema": REQUEST_SCHEMA, "kind": self.kind.value, "epoch": self.epoch,
                "by": self.by, "at": format_timestamp(self.at), "reason": self.reason,
                "placement": self.placement}


def _check_line(name: str, value: object, *, required: bool = False) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"a request's {name} must be non-empty text")
    if "\n" in value or "\r" in value or len(value) > MAX_TEXT:
        raise ConfigError(f"a request's {name} must be one line of at most {MAX_TEXT} "
                          "characters")


def request_time() -> float:
    """Now, at the resolution a record keeps (microseconds), so that a request read back
    equals the one made."""
    return parse_timestamp(format_timestamp(time.time()))


def default_requester() -> str:
    """Who is asking, when the caller does not say: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (a container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def requests_prefix(key_path: str) -> str:
    return f"{KEYS_PREFIX}{key_path}/{REQUESTS_DIR}/"


def request_name(key_path: str, kind: RequestKind, epoch: int) -> str:
    return f"{requests_prefix(key_path)}{epoch:020d}.{RequestKind(kind).value}.json"


def parse_request_name(key_path: str, name: str) -> tuple[RequestKind, int] | None:
    """``(kind, epoch)`` of a request object's name, or None when it is not one's."""
    base = name.rsplit("/", 1)[-1]
    parts = base.split(".")
    if len(parts) != 3 or parts[2] != "json" or len(parts[0]) != 20 or not parts[0].isdigit():
        return None
    try:
        kind = RequestKind(parts[1])
    except ValueError:
        return None
    epoch = int(parts[0])
    return (kind, epoch) if name == request_name(key_path, kind, epoch) else None


def encode_request(request: Request, *, key: tuple[str, ...]) -> bytes:
    return record_bytes(request.to_json(), key=key)


def decode_request(data: bytes, *, kind: RequestKind, epoch: int) -> Request:
    """Parse one record stored as ``kind`` at ``epoch``. Raises ValueError naming what is
    wrong."""
    try:
        doc = load_record(data, schema=REQUEST_SCHEMA, what="request")
        if doc.get("kind") != kind.value or doc.get("epoch") != epoch:
            raise ValueError(f"record says {doc.get('kind')!r} for epoch {doc.get('epoch')!r} "
                             f"but is stored as {kind.value} for {epoch}")
        return Request(kind=kind, epoch=epoch, by=doc["by"], at=parse_timestamp(doc["at"]),
                       reason=doc.get("reason"), placement=doc.get("placement"))
    except (KeyError, TypeError, AttributeError, ConfigError) as e:
        raise ValueError(f"malformed request record: {e}") from None


# -- what a key's requests mean --------------------------------------------------------------


class SuspendState(str, enum.Enum):
    """Where a suspension stands: asked and not yet honoured by the running try; honoured (the
    try stopped with its final snapshot); resume asked and no try started since."""

    REQUESTED = "suspend-requested"
    SUSPENDED = "suspended"
    RESUMING = "resume-requested"


@dataclass(frozen=True)
class Suspension:
    """A key's newest suspend request, its resume (if any) and where it stands."""

    state: SuspendState
    suspend: Request
    resume: Request | None = None
    outcome: OutcomeKind | None = None  # how the targeted try ended, once it has

    @property
    def held(self) -> bool:
        """No new try of the key may start (no resume was asked for yet)."""
        return self.resume is None

    def to_json(self) -> dict[str, object]:
        s, r = self.suspend, self.resume
        return {"state": self.state.value, "epoch": s.epoch, "by": s.by, "at": format_timestamp(s.at),
                "reason": s.reason, "try_outcome": self.outcome.value if self.outcome else None,
                "resumed_by": r.by if r else None, "resumed_at": format_timestamp(r.at) if r else None,
                "placement": r.placement if r else None}


def suspension(requests: Sequence[Request], tries: Sequence[TryLog],
               outcomes: Sequence[Outcome]) -> Suspension | None:
    """The key's suspension that still matters, or None: the newest suspend request, unless
    the key was marked done after it or a try started after its resume."""
    suspends = [r for r in requests if r.kind is RequestKind.SUSPEND]
    if not suspends:
        return None
    ask = max(suspends, key=lambda r: r.epoch)
    later = [t for t in tries if t.epoch > ask.epoch]
    if any(t.done_at is not None for t in tries if t.epoch >= ask.epoch):
        return None
    resume = next((r for r in requests
                   if r.kind is RequestKind.RESUME and r.epoch == ask.epoch), None)
    if resume is not None and later:
        return None  # resumed, and a try has started since
    ended = next((o.outcome for o in outcomes if o.epoch == ask.epoch), None)
    if resume is not None:
        state = SuspendState.RESUMING
    elif ended is None and not later:
        state = SuspendState.REQUESTED
    else:
        state = SuspendState.SUSPENDED
    return Suspension(state, ask, resume, ended)


def suspend_target(key: object, requests: Sequence[Request], tries: Sequence[TryLog],
                   outcomes: Sequence[Outcome]) -> tuple[int, Request | None]:
    """The epoch a suspend of ``key`` targets (its running try), and the request already
    made for it (a second suspend changes nothing). Raises :class:`NotFound` for a key with
    no tries and :class:`ConfigError` for one that is done or has no running try."""
    if not tries:
        raise NotFound(f"key {key} is unknown in this store (no tries); check the key with "
                       "`cairn ls STORE`")
    current = suspension(requests, tries, outcomes)
    if current is not None and current.held:
        return current.suspend.epoch, current.suspend
    latest = tries[-1]
    if latest.done_at is not None:
        raise ConfigError(f"key {key} is done (it succeeded or was removed): there is nothing "
                          "to suspend")
    ended = next((o for o in outcomes if o.epoch == latest.epoch), None)
    if ended is not None:
        raise ConfigError(f"key {key} is not running: its last try (epoch {latest.epoch}) "
                          f"ended {ended.outcome.value}; nothing was changed")
    return latest.epoch, None


def resume_target(key: object, requests: Sequence[Request], tries: Sequence[TryLog],
                  outcomes: Sequence[Outcome], *,
                  placement: str | None = None) -> tuple[int, Request | None]:
    """The epoch whose suspension a resume of ``key`` lifts, and the resume already asked
    for it (a second resume changes nothing). Raises :class:`ConfigError` when ``key`` is not
    suspended or the ``placement`` asked for is not one the suspended try can move to (see
    :func:`check_placement`), :class:`NotFound` when it is unknown."""
    if not tries:
        raise NotFound(f"key {key} is unknown in this store (no tries); check the key with "
                       "`cairn ls STORE`")
    current = suspension(requests, tries, outcomes)
    if current is None:
        raise ConfigError(f"key {key} is not suspended: there is nothing to resume "
                          "(suspend it first with `cairn suspend STORE KEY`)")
    if placement is not None and current.resume is None:
        check_placement(key, placement, current.suspend.epoch, outcomes)
    return current.suspend.epoch, current.resume


def check_placement(key: object, placement: str, epoch: int,
                    outcomes: Sequence[Outcome]) -> None:
    """Refuse (:class:`ConfigError`, nothing changed) a resume of ``key`` on ``placement``
    unless the suspended try ``epoch`` recorded ``placement`` among its capacity options.

    Only a step that runs in its own pod can be moved: its pod spec is cairn's to write, and
    its tries record their options (``Outcome.options``). A step on an Airflow worker records
    none; a try that has not stopped yet has no outcome, and moving it would mean stopping it."""
    ended = next((o for o in outcomes if o.epoch == epoch), None)
    if ended is None:
        raise ConfigError(
            f"cannot resume {key} on placement {placement!r} yet: its try {epoch} has not "
            "stopped (the suspend is not honoured yet). Wait until `cairn ls` shows it "
            "suspended, then resume it with --placement; nothing was changed")
    if not ended.options:
        raise ConfigError(
            f"cannot resume {key} on placement {placement!r}: its try {epoch} recorded no "
            "capacity options. Only a step that runs in its own pod "
            "(CairnKubernetesPodOperator, @task.cairn(pod=...)) with placement= options can be "
            "moved; a step on an Airflow worker cannot be moved at all, since Airflow has no "
            "call that changes a task instance's queue or pool. Resume it without --placement; "
            "nothing was changed")
    if placement not in ended.options:
        raise ConfigError(
            f"cannot resume {key} on placement {placement!r}: it is not one of the step's "
            f"capacity options ({', '.join(ended.options)}); nothing was changed")
