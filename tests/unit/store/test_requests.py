"""Request records: validated on the way in, parsed (never unpickled) on the way out, and how
a key's requests, tries and outcomes say where its suspension stands."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.store.outcomes import Outcome, OutcomeKind, TryLog
from cairn.store.requests import (
    Request,
    RequestKind,
    SuspendState,
    decode_request,
    encode_request,
    parse_request_name,
    request_name,
    request_time,
    suspension,
)

T = 1_800_000_000.0


def ask(kind: str, epoch: int, **kw) -> Request:  # noqa: ANN003
    return Request(kind=kind, epoch=epoch, by="ops@host", at=T + epoch, **kw)


def test_a_record_round_trips_and_its_name_gives_kind_and_epoch() -> None:
    made = Request(kind="resume", epoch=12, by="ops@host", at=request_time(), reason="done")
    data = encode_request(made, key=("a", "b"))
    assert decode_request(data, kind=RequestKind.RESUME, epoch=12) == made
    name = request_name("a/b", RequestKind.RESUME, 12)
    assert parse_request_name("a/b", name) == (RequestKind.RESUME, 12)
    assert parse_request_name("a/b", name.replace(".resume.", ".pause.")) is None
    assert parse_request_name("a/c", name) is None, "another key's record"
    with pytest.raises(ValueError, match="stored as suspend for 12"):
        decode_request(data, kind=RequestKind.SUSPEND, epoch=12)


@pytest.mark.parametrize(("fields", "match"), [
    ({"kind": "pause"}, "unknown request kind"),
    ({"epoch": 0}, "epoch"),
    ({"by": ""}, "by must be non-empty"),
    ({"reason": "two\nlines"}, "one line"),
    ({"reason": "x" * 501}, "at most 500"),
    ({"kind": "suspend", "placement": "a100"}, "only a resume request names a placement"),
])
def test_bad_requests_are_refused_with_the_fix(fields: dict, match: str) -> None:
    base = {"kind": "resume", "epoch": 3, "by": "ops@host", "at": T}
    with pytest.raises(ConfigError, match=match):
        Request(**{**base, **fields})


def test_where_a_suspension_stands() -> None:
    tries = [TryLog(epoch=1, opened_at=T), TryLog(epoch=4, opened_at=T + 10)]
    suspend = ask("suspend", 4, reason="urgent")
    assert suspension([], tries, []) is None
    assert suspension([suspend], tries, []).state is SuspendState.REQUESTED
    ended = [Outcome(epoch=4, outcome=OutcomeKind.SUSPENDED, started_at=T, ended_at=T + 1)]
    held = suspension([suspend], tries, ended)
    assert held.state is SuspendState.SUSPENDED and held.held
    assert held.to_json()["reason"] == "urgent" and held.to_json()["try_outcome"] == "suspended"
    resumed = suspension([suspend, ask("resume", 4)], tries, ended)
    assert resumed.state is SuspendState.RESUMING and not resumed.held
    later = [*tries, TryLog(epoch=6, opened_at=T + 20)]
    assert suspension([suspend, ask("resume", 4)], later, ended) is None
    done = [TryLog(epoch=1, opened_at=T), TryLog(epoch=4, opened_at=T + 10, done_at=T + 11)]
    assert suspension([suspend], done, []) is None
