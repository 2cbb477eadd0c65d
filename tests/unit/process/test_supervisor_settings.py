from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.process.supervisor import RunSettings, parse_duration


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("10m", 600), ("1h", 3600),
                                          ("1.5h", 5400), ("45", 45), ("250ms", 0.25),
                                          ("2d", 172800)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10 minutes", "-5s", "0s", "1y", "s"])
def test_bad_durations_name_the_format(text: str) -> None:
    with pytest.raises(ConfigError, match="like 30s, 10m or 1h"):
        parse_duration(text)


def test_a_command_is_required() -> None:
    with pytest.raises(ConfigError, match="after --"):
        RunSettings(store="/tmp/s", key="k", argv=())
