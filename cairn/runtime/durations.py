"""Durations, one grammar everywhere: ``"250ms"``, ``"30s"``, ``"10m"``, ``"1.5h"``, ``"2d"``,
or a bare number of seconds (``"45"``, ``45``, ``0.5``).

``cairn run --every/--grace``, ``cairn gc --grace``, the sidecar's windows, the pod transform
and the Airflow operators all parse with :func:`parse_duration`; what they hand to another
process they write with :func:`format_duration`, which :func:`parse_duration` reads back.
"""

from __future__ import annotations

import math
import re

from cairn.exceptions import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
FORMS = "a positive number with an optional unit (ms, s, m, h, d), like 30s, 10m or 1h"


def parse_duration(text: str | float, *, allow_zero: bool = False, name: str = "duration") -> float:
    """``text`` in seconds; ConfigError naming the accepted forms for anything else (zero only
    with ``allow_zero``)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text))
        seconds = float(m.group(1)) * _UNITS[m.group(2)] if m else -1.0
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(f"bad {name} {text!r}: give {FORMS}"
                          + (" (or 0)" if allow_zero else ""))
    return seconds


def format_duration(value: str | float, *, name: str = "duration") -> str:
    """``value`` (seconds, or a duration text) as text :func:`parse_duration` accepts,
    checked now so that a bad value fails where it was written."""
    seconds = parse_duration(value, name=name)
    return f"{seconds:g}s" if isinstance(value, (int, float)) else str(value).strip()
