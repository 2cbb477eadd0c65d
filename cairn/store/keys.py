"""Keys name a unit of work (an Airflow task instance, a KFP task), never a pod or a try.

A key is a tuple of text components. Each component is percent-encoded into a path segment
made only of ``[A-Za-z0-9._-]`` (a leading ``.`` is encoded too, so no segment is ``.``,
``..`` or hidden); an encoded component over 200 bytes is replaced by ``~`` and a BLAKE3
digest of it (``~`` never appears otherwise), which keeps object names within the limits of
every backend. The original components are kept in the slot log's records for display.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

import blake3

from cairn.exceptions import ConfigError

MAX_COMPONENT_BYTES = 200
MAX_COMPONENTS = 16
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def encode_component(component: str) -> str:
    """The path segment for one key component (see the module docstring)."""
    if not isinstance(component, str):
        raise ConfigError(f"key components must be text, got {type(component).__name__}")
    if component == "":
        raise ConfigError("a key component is empty; remove the doubled '/' or give a value")
    try:
        raw = component.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"key component {component!r} is not valid unicode text") from None
    out = []
    for i, byte in enumerate(raw):
        if byte in _SAFE and not (i == 0 and byte == ord(".")):
            out.append(chr(byte))
        else:
            out.append(f"%{byte:02X}")
    encoded = "".join(out)
    if len(encoded) > MAX_COMPONENT_BYTES:
        return "~" + blake3.blake3(raw).hexdigest()[:48]
    return encoded


@dataclass(frozen=True)
class Key:
    """The identity of a step's work. ``Key.parse("dag/task/run/0")`` or ``Key(("a", "b"))``."""

    components: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.components, str) or not isinstance(self.components, tuple):
            raise ConfigError("Key takes a tuple of components; use Key.parse() for a string")
        if not self.components:
            raise ConfigError("a key needs at least one component, such as 'my-dag/train'")
        if len(self.components) > MAX_COMPONENTS:
            raise ConfigError(f"a key has at most {MAX_COMPONENTS} components")
        for component in self.components:
            encode_component(component)

    @classmethod
    def parse(cls, text: str) -> Key:
        """Split ``text`` on ``/``; ``%XX`` in a part stands for that byte (``%2F`` for ``/``)."""
        if not isinstance(text, str) or not text.strip("/"):
            raise ConfigError(f"empty key {text!r}; give one such as 'my-dag/train/run-1'")
        parts = text.strip("/").split("/")
        return cls(tuple(unquote(part, errors="strict") for part in parts))

    @property
    def path(self) -> str:
        """The ``/``-joined encoded segments: where this key lives in a store."""
        return "/".join(encode_component(c) for c in self.components)

    def __str__(self) -> str:
        return "/".join(c.replace("%", "%25").replace("/", "%2F") for c in self.components)
