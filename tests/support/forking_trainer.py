"""A trainer that forks a child which outlives it, as a DataLoader worker can.

``python -m tests.support.forking_trainer STORE KEY`` commits one snapshot (which starts the
writer process), then forks a child that blocks forever (a worker stuck on a lock its killed
main process held), prints ``writer PID`` and ``child PID`` and waits to be killed.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from cairn.state import Checkpointer


def main() -> int:
    store, key = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(4, 4)
    ckpt = Checkpointer(store=store, key=key, every_steps=1, every_seconds=None, preemption=None)
    ckpt.restore(model=model)
    ckpt.step(0)
    ckpt.wait(timeout=120)
    child = os.fork()
    if child == 0:
        while True:  # no exit of its own: only a signal ends it
            time.sleep(3600)
    print(f"writer {ckpt.writer_pid}", flush=True)
    print(f"child {child}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
