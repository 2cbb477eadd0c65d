"""A small workload that knows nothing of cairn: N numbered steps, each appended to a metrics
file (append mode) and printed, with a pause between them; exit 0 at the end.

    python counter_steps.py METRICS STEPS [SLEEP_SECONDS]
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    metrics, steps = sys.argv[1], int(sys.argv[2])
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
    with open(metrics, "a") as out:
        for step in range(steps):
            out.write(f"{step}\n")
            out.flush()
            print(f"step {step}", flush=True)
            time.sleep(pause)
    print("done", flush=True)


if __name__ == "__main__":
    main()
