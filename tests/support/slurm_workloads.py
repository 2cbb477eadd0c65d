"""The two workloads the SLURM tests submit (``python -m tests.support.slurm_workloads ...``
from the repository root), each logging every step it completes to a progress file opened per
line, as ``<mode> <step> <SLURM_RESTART_COUNT>``:

* ``process PROGRESS STEPS PAUSE``: knows nothing of cairn (``cairn run`` snapshots it);
  the restart count is the one it started with (a restored process keeps its environment);
* ``state PROGRESS STEPS PAUSE``: a small torch model trained with
  ``Checkpointer.from_env()`` (store from ``CAIRN_STORE``, key from the SLURM job), a snapshot
  every ``CAIRN_EVERY_STEPS``; a preemption notice (SIGTERM) ends it with the final snapshot
  and exit 75 (76 without one), as ``cairn run`` would.
"""

from __future__ import annotations

import os
import sys
import time


def _log(progress: str, mode: str, step: int) -> None:
    with open(progress, "a") as f:
        f.write(f"{mode} {step} {os.environ.get('SLURM_RESTART_COUNT', '0')}\n")


def process(progress: str, steps: int, pause: float) -> int:
    for step in range(steps):
        time.sleep(pause)
        _log(progress, "process", step)
    return 0


def state(progress: str, steps: int, pause: float) -> int:
    import torch

    from cairn.exceptions import Preempted, PreemptedExit
    from cairn.runtime import env, slurm
    from cairn.runtime.exits import exit_code_for
    from cairn.state import Checkpointer
    from cairn.tries import Try

    torch.manual_seed(1)
    torch.set_num_threads(1)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Nothing to set up for SIGTERM: with the default handler before it, the Checkpointer
    # raises PreemptedExit after the final snapshot, which exits 75/76 once re-raised below.
    # The try object records this try's outcome (with the SLURM job and node).
    attempt = Try.begin(store=env.STORE.get() or "", key=slurm.default_key() or "")
    ckpt = Checkpointer.from_env()
    start = ckpt.restore(model=model, optimizer=opt)
    try:
        for step in range(start, steps):
            time.sleep(pause)
            loss = model(torch.ones(4, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            _log(progress, "state", step)
            ckpt.step(step)
    except Preempted as e:
        print(f"preempted: {e}", flush=True)
        ckpt.close()
        attempt.ended(error=e, ckpt=ckpt)
        assert isinstance(e, PreemptedExit) and e.code == exit_code_for(e), e
        raise
    attempt.ended(error=None, ckpt=ckpt)
    attempt.finish(ckpt)
    ckpt.close()
    return 0


if __name__ == "__main__":
    mode, progress, steps, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    sys.exit({"process": process, "state": state}[mode](progress, steps, pause))
