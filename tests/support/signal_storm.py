"""Waits in a loop while another process floods it with SIGUSR1, whose handler wakes the
waiter: the situation of ``cairn run`` (SIGCHLD) and the sidecar (SIGTERM).

    python signal_storm.py wakeup|event SECONDS

Prints ``waits=N signals=M`` and exits 0 when the loop ran its time; a handler that deadlocks
against the waiter leaves the process hung (the caller's timeout says so).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from cairn.runtime.wakeup import Wakeup


def main() -> None:
    kind, seconds = sys.argv[1], float(sys.argv[2])
    signals = 0
    if kind == "wakeup":
        wakeup = Wakeup()

        def wait(timeout: float) -> None:
            wakeup.wait(timeout)

        wake = wakeup.set
    else:  # the pattern cairn used before: Event.set() in the handler
        event = threading.Event()

        def wait(timeout: float) -> None:
            event.wait(timeout)
            event.clear()

        wake = event.set

    def handler(_signum: int, _frame: object) -> None:
        nonlocal signals
        signals += 1
        wake()

    signal.signal(signal.SIGUSR1, handler)
    print("ready", flush=True)
    waits, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        wait(0.001)
        waits += 1
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    print(f"waits={waits} signals={signals}", flush=True)


if __name__ == "__main__":
    main()
