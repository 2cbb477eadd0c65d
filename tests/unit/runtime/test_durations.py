"""One duration grammar: what cairn run, cairn gc, the sidecar and the operators accept."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.runtime.durations import format_duration, parse_duration


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("10m", 600), ("1h", 3600),
                                          ("1.5h", 5400), ("45", 45), ("250ms", 0.25),
                                          ("2d", 172800), (5, 5), (0.5, 0.5)])
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10 minutes", "-5s", "0s", "1y", "s", -3, float("inf")])
def test_bad_durations_name_the_format(text: str | float) -> None:
    with pytest.raises(ConfigError, match="like 30s, 10m or 1h"):
        parse_duration(text)


def test_zero_only_where_allowed() -> None:
    assert parse_duration("0", allow_zero=True) == 0.0
    assert parse_duration("0s", allow_zero=True) == 0.0
    with pytest.raises(ConfigError, match=r"bad --grace '-1s'.*\(or 0\)"):
        parse_duration("-1s", allow_zero=True, name="--grace")


@pytest.mark.parametrize("value", [30, 0.25, "10m", " 1h ", "45"])
def test_formatted_durations_parse_back(value: str | float) -> None:
    assert parse_duration(format_duration(value)) == pytest.approx(parse_duration(value))


def test_format_refuses_what_parse_refuses() -> None:
    with pytest.raises(ConfigError, match="bad every"):
        format_duration(0, name="every")
