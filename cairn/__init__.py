"""cairn: snapshots that let long pipeline steps resume where they stopped.

``cairn.Checkpointer`` is :class:`cairn.state.checkpointer.Checkpointer`; importing ``cairn``
does not import torch (the first use of ``cairn.Checkpointer`` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cairn.state.checkpointer import Checkpointer

__version__ = "0.1.0.dev0"

__all__ = ["Checkpointer", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from cairn.state.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'cairn' has no attribute {name!r}")
