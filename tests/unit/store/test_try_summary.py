"""``TrySummary``: what a try did, as outcome records and ``open`` notes keep it."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.store.outcomes import Outcome, OutcomeKind, TrySummary, decode_outcome, encode_outcome


def test_a_summary_round_trips_through_an_outcome_record() -> None:
    summary = TrySummary(snapshots=7, last_step=139, last_seq=12, bytes_logical=1 << 30,
                         bytes_written=3 << 28, stall_s=4.25, seconds_per_step=0.5,
                         complete=False)
    outcome = Outcome(epoch=5, outcome=OutcomeKind.SUSPENDED, started_at=10.0, ended_at=20.0,
                      options=("l4-spot", "l4-on-demand"), summary=summary)
    got = decode_outcome(encode_outcome(outcome, key=("a", "b")), epoch=5)
    assert got == outcome and got.summary == summary


def test_a_newer_summary_with_more_fields_still_reads() -> None:
    doc = {**TrySummary(snapshots=2).to_json(), "gpu_bytes": 12}
    assert TrySummary.from_json(doc) == TrySummary(snapshots=2)


@pytest.mark.parametrize("bad, match", [
    (dict(snapshots=-1), "snapshots"),
    (dict(snapshots=None), "snapshots"),
    (dict(last_step=True), "last_step"),
    (dict(bytes_written=1.5), "bytes_written"),
    (dict(stall_s=float("inf")), "stall_s"),
    (dict(seconds_per_step=-0.1), "seconds_per_step"),
    (dict(complete="yes"), "complete"),
])
def test_bad_summaries_are_refused_naming_the_field(bad: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrySummary(**bad)
    with pytest.raises(ValueError, match=match):
        TrySummary.from_json({**TrySummary().to_json(), **bad})


@pytest.mark.parametrize("options, match", [("l4-spot", "list of capacity option names"),
                                            (("",), "capacity option names")])
def test_bad_option_lists_are_refused(options: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Outcome(epoch=1, outcome=OutcomeKind.FAILED, started_at=1.0, ended_at=1.0,
                options=options)  # type: ignore[arg-type]
