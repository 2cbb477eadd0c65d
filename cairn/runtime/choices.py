"""Policy options given as an enum member or its text (a CLI flag, an environment variable, an
operator's argument), turned into the member with one error message for every option."""

from __future__ import annotations

import enum
from typing import Any

from cairn.exceptions import ConfigError


def coerce_option(enum_type: type[enum.Enum], value: object, what: str) -> Any:
    """``value`` (a member or its value) as a member of ``enum_type``; ConfigError naming the
    choices otherwise (``what``: the option as the user gave it, e.g. ``--staging``)."""
    try:
        return enum_type(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ConfigError(f"{what} {value!r} is not one of {choices}") from None
