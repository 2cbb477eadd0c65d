"""The records beside a key's slot log: how each try ended (outcomes), an operator's suspend
and resume requests, and the tries they describe. Reached as :attr:`cairn.store.Store.records`;
the snapshots themselves are the :class:`~cairn.store.Store`'s.

Each record is one create-only object, sealed like any other on an encrypted store; a record
that does not read or parse is skipped with a warning (records are advice, never a verdict on
a snapshot). Thread contract: as the store's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cairn.exceptions import AlreadyExists, NotFound
from cairn.store.backend import Backend
from cairn.store.keys import Key
from cairn.store.outcomes import (
    Outcome,
    TryLog,
    TrySummary,
    decode_outcome,
    encode_outcome,
    epoch_from_name,
    outcome_name,
    outcomes_prefix,
    tries_from_records,
    try_summaries,
)
from cairn.store.requests import (
    Request,
    RequestKind,
    Suspension,
    decode_request,
    default_requester,
    encode_request,
    parse_request_name,
    request_name,
    request_time,
    requests_prefix,
    resume_target,
    suspend_target,
    suspension,
)
from cairn.store.slotlog import Record, SlotLog

log = logging.getLogger(__name__)


class Records:
    """A store's records (see the module docstring) over its backend (the sealing view of an
    encrypted store)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def _history(self, key: Key) -> list[Record]:
        return SlotLog(self._backend, key).records()

    # -- outcome records (cairn.store.outcomes): how each try ended, for cairn.policy --------

    def record_outcome(self, key: Key, outcome: Outcome) -> None:
        """Store how try ``outcome.epoch`` of ``key`` ended, create-only: a second record for
        the same epoch raises :class:`AlreadyExists` and leaves the first as it was."""
        try:
            self._backend.create(outcome_name(key.path, outcome.epoch),
                                encode_outcome(outcome, key=key.components))
        except AlreadyExists:
            raise AlreadyExists(f"key {key}: try {outcome.epoch} already has an outcome record; "
                                "each try's outcome is written once") from None

    def outcomes(self, key: Key) -> list[Outcome]:
        """Every readable outcome record of ``key``, oldest epoch first; unreadable or
        unknown-schema records are skipped with a warning."""
        def decoder(name: str) -> Callable[[bytes], Outcome] | None:
            epoch = epoch_from_name(name)
            if epoch is None or name != outcome_name(key.path, epoch):
                return None
            return lambda data: decode_outcome(data, epoch=epoch)

        return self._beside_log(key, outcomes_prefix(key.path), decoder, "outcome")

    def _beside_log(self, key: Key, prefix: str, decoder: Callable[[str], Any],
                    what: str) -> list[Any]:
        """The readable records under ``prefix`` in listing order: ``decoder(name)`` parses
        one's bytes (raising ValueError), or is None for a name that is not a record's."""
        out = []
        for info in self._backend.list(prefix):
            decode = decoder(info.name)
            if decode is None:
                continue
            try:
                out.append(decode(self._backend.read(info.name)))
            except NotFound:
                continue
            except ValueError as e:
                log.warning("key %s: skipping %s record %s: %s", key, what, info.name, e)
        return out

    # -- suspend and resume requests (cairn.store.requests): an operator's asks --------------

    def requests(self, key: Key) -> list[Request]:
        """Every readable request record of ``key``, by epoch (a suspend before its resume)."""
        def decoder(name: str) -> Callable[[bytes], Request] | None:
            parsed = parse_request_name(key.path, name)
            if parsed is None:
                return None
            return lambda data: decode_request(data, kind=parsed[0], epoch=parsed[1])

        found = self._beside_log(key, requests_prefix(key.path), decoder, "request")
        return sorted(found, key=lambda r: (r.epoch, r.kind is RequestKind.RESUME))

    def suspension(self, key: Key) -> Suspension | None:
        """``key``'s suspension that still matters (see :func:`cairn.store.requests.suspension`);
        one listing when the key has no requests."""
        asked = self.requests(key)
        return suspension(asked, self.tries(key), self.outcomes(key)) if asked else None

    def request_suspend(self, key: Key, *, by: str | None = None,
                        reason: str | None = None) -> Request:
        """Ask ``key``'s running try to take a final snapshot and stop; durable when it
        returns. Asking again returns the first request unchanged. Raises NotFound for an
        unknown key, ConfigError for one that is done or not running (nothing is written)."""
        epoch, made = suspend_target(key, self.requests(key), self.tries(key), self.outcomes(key))
        return made or self._create_request(key, Request(
            RequestKind.SUSPEND, epoch, by or default_requester(), request_time(), reason))

    def request_resume(self, key: Key, *, by: str | None = None, reason: str | None = None,
                       placement: str | None = None) -> Request:
        """Lift ``key``'s suspension: its next try may start, and resumes from the suspend
        snapshot; durable when it returns. ``placement``: move the step to that capacity
        option, which its suspended try must have recorded (a pod-based step with
        ``placement=``; docs/adr/0031). Asking again returns the first request. Raises
        ConfigError when ``key`` is not suspended or cannot be moved there (nothing is
        written)."""
        epoch, made = resume_target(key, self.requests(key), self.tries(key), self.outcomes(key),
                                    placement=placement)
        return made or self._create_request(key, Request(
            RequestKind.RESUME, epoch, by or default_requester(), request_time(), reason,
            placement))

    def pending_suspend(self, key: Key, *, epoch: int) -> Request | None:
        """The suspend request try ``epoch`` must honour, None when there is none or it was
        resumed meanwhile: what a running try polls (one or two reads, no listing)."""
        ask = self._read_request(key, RequestKind.SUSPEND, epoch)
        return ask if ask is not None and self._read_request(
            key, RequestKind.RESUME, epoch) is None else None

    def _read_request(self, key: Key, kind: RequestKind, epoch: int) -> Request | None:
        name = request_name(key.path, kind, epoch)
        try:
            return decode_request(self._backend.read(name), kind=kind, epoch=epoch)
        except NotFound:
            return None
        except ValueError as e:
            log.warning("key %s: skipping request record %s: %s", key, name, e)
            return None

    def _create_request(self, key: Key, request: Request) -> Request:
        try:
            self._backend.create(request_name(key.path, request.kind, request.epoch),
                                encode_request(request, key=key.components))
            return request
        except AlreadyExists:  # asked at the same moment by someone else: theirs stands
            return self._read_request(key, request.kind, request.epoch) or request

    def try_summaries(self, key: Key) -> dict[int, TrySummary]:
        """What each try of ``key`` did, by epoch, as far as retention leaves it known (see
        :func:`cairn.store.outcomes.try_summaries`)."""
        return try_summaries(self._history(key), self.outcomes(key))

    def tries(self, key: Key) -> list[TryLog]:
        """Each try (epoch) as the slot log records it: opened, snapshots kept, done."""
        return tries_from_records(self._history(key))
