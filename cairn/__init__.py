"""cairn: snapshots that let long pipeline steps resume where they stopped.

The public API, what the README's examples use::

    from cairn import Checkpointer, Key, open_store, ResumePolicy, Try

Every name is imported on first use (``import cairn`` imports neither torch nor a cloud
client; ``cairn.Checkpointer`` imports torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cairn.version import __version__

if TYPE_CHECKING:
    from cairn.exceptions import CairnError, ConfigError, Fenced, GaveUp, Preempted, Suspended
    from cairn.policy.resume import AfterTry, ResumeOn, ResumePolicy
    from cairn.state.checkpointer import Checkpointer, PersistMode, WhenBusy
    from cairn.runtime.stores import open_store
    from cairn.store import Key, Store
    from cairn.tries import Try

_PUBLIC = {
    "Checkpointer": "cairn.state.checkpointer",
    "PersistMode": "cairn.state.checkpointer",
    "WhenBusy": "cairn.state.checkpointer",
    "LrScaling": "cairn.state.options",
    "Key": "cairn.store",
    "Store": "cairn.store",
    "open_store": "cairn.runtime.stores",
    "AfterTry": "cairn.policy.resume",
    "ResumeOn": "cairn.policy.resume",
    "ResumePolicy": "cairn.policy.resume",
    "Try": "cairn.tries",
    "CairnError": "cairn.exceptions",
    "ConfigError": "cairn.exceptions",
    "Fenced": "cairn.exceptions",
    "GaveUp": "cairn.exceptions",
    "Preempted": "cairn.exceptions",
    "Suspended": "cairn.exceptions",
}

__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'cairn' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
