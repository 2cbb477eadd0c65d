"""Echo the workload's log files to ``cairn run``'s own stdout and stderr as they grow.

The workload writes to supervisor-owned files (so that they can be stored with each snapshot
and cut back before a restore); a thread copies what is appended to the supervisor's streams,
where the orchestrator's task log reads it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

# How often the files are looked at. The user watching ``cairn run``'s output waits up to this
# long for a line the workload has written: at 0.2 s, a restored workload's first step showed
# 0.2 s after it happened (measured at 256 MiB, where plain CRIU's whole restore takes 0.3 s).
# A look is one stat(2) per file when nothing was written.
POLL_S = 0.02


class LogEcho(threading.Thread):
    """Copies what the workload appends to its log files to the supervisor's stdout/stderr.
    Touches only the files it reads and the streams it writes; :meth:`stop` from any thread."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(name="cairn-log-echo", daemon=True)
        self._pairs = pairs
        self._offsets = {path: 0 for path, _ in pairs}
        self._halt = threading.Event()

    def start_at(self, offsets: dict[str, int]) -> None:
        """Start, showing each file from ``offsets`` on (what a restored workload already
        wrote was shown by the try that wrote it)."""
        self._offsets.update(offsets)
        self.start()

    def _pump(self) -> None:
        for path, stream in self._pairs:
            try:
                if os.stat(path).st_size <= self._offsets[path]:
                    continue
                with open(path, "rb") as f:
                    f.seek(self._offsets[path])
                    data = f.read()
            except OSError:
                continue
            if data:
                self._offsets[path] += len(data)
                stream.write(data)
                stream.flush()

    def run(self) -> None:
        self._pump()  # what was written while the restore finished shows at once
        while not self._halt.wait(POLL_S):
            self._pump()
        self._pump()

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5)
