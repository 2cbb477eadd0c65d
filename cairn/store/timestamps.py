"""The store's timestamps: UTC to the microsecond, written as ``2026-11-29T22:04:04.123456Z``.

Every time a store record holds (a slot-log record's ``created_at``, an outcome's
``started_at`` and ``ended_at``, a request's ``at``) is written by :func:`format_timestamp`
and read back by :func:`parse_timestamp`, here and in the integrations (``cairn.store``
exports both).
"""

from __future__ import annotations

from datetime import datetime, timezone

TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def format_timestamp(ts: float | None = None) -> str:
    """``ts`` (seconds since the Unix epoch; None: now) in the store's form."""
    when = datetime.now(timezone.utc) if ts is None else datetime.fromtimestamp(ts, timezone.utc)
    return when.strftime(TIMESTAMP_FORMAT)


def parse_timestamp(text: str) -> float:
    """Seconds since the Unix epoch of ``text``: the store's form, or any RFC 3339 time with
    ``Z`` or an offset (Kubernetes writes those, some without a fraction). Raises ValueError
    for anything else, a time without a zone included (which one would be a guess)."""
    if not isinstance(text, str):
        raise ValueError(f"not a timestamp: {text!r}")
    try:
        # Python 3.10's fromisoformat reads no "Z" (3.11's does).
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a timestamp: {text!r}") from None
    if when.tzinfo is None:
        raise ValueError(f"timestamp {text!r} names no time zone")
    return when.timestamp()
