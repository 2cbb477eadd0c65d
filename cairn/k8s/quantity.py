"""Kubernetes resource quantities for memory and storage: parse to bytes, format from bytes."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from cairn.exceptions import ConfigError

_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m))?$")


def parse_bytes(value: str | int | float, *, what: str = "quantity") -> int:
    """``"16Gi"``, ``"500M"``, ``"1e9"``, ``129e6`` or an int to bytes (rounded up)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} {value!r} is not a quantity")
    if isinstance(value, int):
        number = Decimal(value)
    else:
        m = _QUANTITY.match(str(value).strip())
        if not m:
            raise ConfigError(f"{what} {value!r} is not a Kubernetes quantity such as 16Gi, "
                              "512Mi or 1e9")
        try:
            number = Decimal(m.group(1))
        except InvalidOperation:
            raise ConfigError(f"{what} {value!r} is not a number") from None
        if m.group(2):
            number *= Decimal(10) ** int(m.group(2)[1:])
        elif m.group(3) == "m":
            number /= 1000
        elif m.group(3):
            number *= _SUFFIX[m.group(3)]
    if number < 0:
        raise ConfigError(f"{what} {value!r} is negative")
    return int(math.ceil(number))


def format_bytes(n: int) -> str:
    """The largest binary suffix that divides ``n`` exactly (``17179869184`` → ``16Gi``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if n and n % _SUFFIX[suffix] == 0:
            return f"{n // _SUFFIX[suffix]}{suffix}"
    return str(n)


def round_up_mib(n: int) -> int:
    return -(-n // 2**20) * 2**20
