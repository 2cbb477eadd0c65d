"""cairn: snapshots that let long pipeline steps resume where they stopped."""

from __future__ import annotations

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
