"""A small workload that knows nothing of cairn: N numbered steps, each appended to a metrics
file (append mode) and printed, with a pause between them; exit 0 at the end.

    python counter_steps.py METRICS STEPS [SLEEP_SECONDS]
"""

from __future__ import annotations

import sys
import time


def arguments() -> tuple[str, int, float]:
    """``METRICS STEPS [SLEEP_SECONDS]`` from the command line."""
    return sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.05


def count(metrics: str, steps: int, pause: float) -> None:
    """Append and print steps 0 .. ``steps``-1, ``pause`` seconds apart."""
    with open(metrics, "a") as out:
        for step in range(steps):
            out.write(f"{step}\n")
            out.flush()
            print(f"step {step}", flush=True)
            time.sleep(pause)


def main() -> None:
    count(*arguments())
    print("done", flush=True)


if __name__ == "__main__":
    main()
