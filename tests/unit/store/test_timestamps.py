"""The store's one timestamp form: written in UTC to the microsecond, read back exactly, and
RFC 3339 times from elsewhere (Kubernetes) read too; text with no zone or no time refused."""

from __future__ import annotations

import re
import time

import pytest

from cairn.store.timestamps import format_timestamp, parse_timestamp


def test_a_timestamp_is_utc_to_the_microsecond_and_reads_back_exactly() -> None:
    assert format_timestamp(1_800_000_000.123456) == "2027-01-15T08:00:00.123456Z"
    assert parse_timestamp("2027-01-15T08:00:00.123456Z") == 1_800_000_000.123456
    assert format_timestamp(0) == "1970-01-01T00:00:00.000000Z"


def test_without_an_argument_it_is_now() -> None:
    before = time.time()
    text = format_timestamp()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", text)
    assert before - 1e-6 <= parse_timestamp(text) <= time.time()


@pytest.mark.parametrize("text", ["2027-01-15T08:00:00Z", "2027-01-15T08:00:00+00:00",
                                  "2027-01-15T09:00:00+01:00", "2027-01-15T08:00:00.000Z"])
def test_rfc_3339_times_with_a_zone_are_read(text: str) -> None:
    assert parse_timestamp(text) == 1_800_000_000.0


@pytest.mark.parametrize("text", ["", "yesterday", "2027-01-15T08:00:00", "2027-13-01T00:00:00Z",
                                  None, 1_800_000_000])
def test_anything_else_is_a_value_error(text: object) -> None:
    with pytest.raises(ValueError):
        parse_timestamp(text)  # type: ignore[arg-type]
