"""Run a training module as a subprocess, SIGKILL it after a line, and compare runs.

Shared by the bit-identical resume tests: a run prints ``loss STEP VALUE`` per optimizer step
and writes its final weights with ``torch.save(state_dict)``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.hang import HANG_S

REPO = Path(__file__).resolve().parents[2]


def start(module: str, *args: str, stderr: int = subprocess.STDOUT,
          env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m module *args`` from the repository root, ``env`` added to the environment;
    its stderr goes to its stdout unless ``stderr`` says otherwise (``subprocess.DEVNULL``)."""
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen[str]) -> list[str]:
    try:
        out, _ = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # a hung run must not outlive the test
        proc.communicate()
        raise
    assert proc.returncode == 0, out[-3000:]
    return out.splitlines()


def kill_after(proc: subprocess.Popen[str], line: str) -> list[str]:
    """SIGKILL ``proc`` once it printed ``line``; its whole output."""
    assert proc.stdout is not None
    seen = []
    for got in proc.stdout:
        seen.append(got.strip())
        if got.strip() == line:
            proc.send_signal(signal.SIGKILL)
            break
    seen += [got.strip() for got in proc.stdout]
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, seen[-5:]
    return seen


def losses(lines: list[str]) -> dict[int, str]:
    return {int(m[1]): m[2] for line in lines if (m := re.match(r"loss (\d+) (\S+)", line))}


def same_weights(a: Path, b: Path) -> None:
    import torch

    want, got = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
