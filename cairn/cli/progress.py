"""A dependency-free progress bar for long transfers (sizes: :mod:`cairn.runtime.units`)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from cairn.runtime.units import human_size

__all__ = ["ProgressBar", "human_size"]


class ProgressBar:
    """Draws ``label [####    ] 1.2 GiB / 4.0 GiB 310 MiB/s`` on a terminal, at most 10×/s.

    Silent when ``stream`` is not a terminal or ``enabled`` is false, so scripts and logs
    stay clean. Call it with the number of bytes just done.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= 0.1 or self.done >= self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 24
        filled = int(frac * width)
        rate = self.done / max(now - self._start, 1e-6)
        self.stream.write(f"\r{self.label} [{'#' * filled}{' ' * (width - filled)}] "
                          f"{human_size(self.done)} / {human_size(self.total)} "
                          f"{human_size(rate)}/s ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
