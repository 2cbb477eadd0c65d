"""Functions the ready components import by path in the kfp.local tests (``kfp_workloads:fit``).

The tests put this directory on ``PYTHONPATH``, which kfp.local's task processes inherit.
"""

from __future__ import annotations

import os
import signal
from typing import Any


def _train_step(model: Any, opt: Any, step: int) -> float:
    import torch

    g = torch.Generator().manual_seed(step)  # each step's batch depends on the step alone
    x = torch.randn(8, 4, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _model() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def fit(ckpt: Any, steps: int, kill_at: int, marker: str, log: str) -> dict[str, Any]:
    """Train ``steps`` steps; on the first attempt (no ``marker`` file yet), SIGKILL this
    process right after step ``kill_at``. ``log`` gets ``start N`` and ``step N`` lines."""

    def after(step: int) -> None:
        with open(log, "a") as f:
            f.write(f"step {step}\n")
        if step == kill_at and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    return _fit(ckpt, steps, log, after)


def _fit(ckpt: Any, steps: int, log: str, after: Any) -> dict[str, Any]:
    """Restore, train from the next step to ``steps`` calling ``after(step)`` after each
    step's snapshot decision; ``log`` gets a ``start N`` line."""
    model, opt = _model()
    start = ckpt.restore(model=model, optimizer=opt)
    with open(log, "a") as f:
        f.write(f"start {start}\n")
    for step in range(start, steps):
        _train_step(model, opt, step)
        ckpt.step(step)
        after(step)
    return {"weight": model.weight.flatten().tolist(), "bias": model.bias.tolist(),
            "start": start}


def reference(steps: int) -> dict[str, Any]:
    """What :func:`fit` computes when nothing interrupts it, without cairn."""
    model, opt = _model()
    for step in range(steps):
        _train_step(model, opt, step)
    return {"weight": model.weight.flatten().tolist(), "bias": model.bias.tolist()}


def shout(src: str, dst: str) -> None:
    """A predictor: upper-cases one input file. ``$CAIRN_KFP_TEST_DIR/calls`` gets one line
    per call; on the first attempt it wipes the output directory and SIGKILLs this process
    just before returning for the input named ``$CAIRN_KFP_TEST_KILL_AT``."""
    base = os.environ["CAIRN_KFP_TEST_DIR"]
    name = os.path.basename(src)
    with open(src) as f:
        text = f.read()
    with open(dst, "w") as f:
        f.write(text.upper())
    with open(os.path.join(base, "calls"), "a") as f:
        f.write(name + "\n")
    marker = os.path.join(base, "killed")
    if name == os.environ.get("CAIRN_KFP_TEST_KILL_AT") and not os.path.exists(marker):
        open(marker, "w").close()
        out_dir = os.path.dirname(dst)
        for entry in os.listdir(out_dir):  # what a retry on another node starts with: nothing
            os.remove(os.path.join(out_dir, entry))
        os.kill(os.getpid(), signal.SIGKILL)


def fit_with_a_bug(ckpt: Any, steps: int, fail_at: int, marker: str, log: str) -> dict[str, Any]:
    """Like :func:`fit`, but the step's own bug: raise at step ``fail_at`` — on every attempt
    when ``marker`` is empty, on the first one only otherwise."""

    def after(step: int) -> None:
        if step == fail_at and not (marker and os.path.exists(marker)):
            if marker:
                open(marker, "w").close()
            raise RuntimeError(f"a bug at step {step}")

    return _fit(ckpt, steps, log, after)
