"""State mode: cooperative snapshots of framework state (torch first).

Importing :mod:`cairn.state` does not import torch; :class:`Checkpointer` does, when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cairn.state.checkpointer import Checkpointer

__all__ = ["Checkpointer"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from cairn.state.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(name)
