"""counter_steps.py's workload holding a known marker string in its memory (8 MiB of it), so
a test can check that no object of an encrypted store holds it in plaintext.

    python marker_counter.py METRICS STEPS [SLEEP_SECONDS]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from counter_steps import arguments, count  # noqa: E402

MARKER = b"cairn-process-marker-0d1e5b"


def main() -> None:
    held = bytearray(MARKER * ((8 << 20) // len(MARKER)))  # in the process image's pages
    count(*arguments())
    print("done", len(held), flush=True)


if __name__ == "__main__":
    main()
