"""The Checkpointer raises before training when its store cannot be reached (ADR 0032)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cairn.exceptions import StoreUnreachable
from cairn.runtime import env
from cairn.runtime.exits import ExitCode
from cairn.state import Checkpointer
from tests.support.stopped_gcs import EMULATOR, stopped_gcs_store



def _train(ckpt_factory, steps: list[int]) -> None:  # noqa: ANN001 - a callable
    """What a training script does: open, restore, then train from the step it returns."""
    model = torch.nn.Linear(2, 1)
    ckpt = ckpt_factory()
    for step in range(ckpt.restore(model=model), 3):
        steps.append(step)
        ckpt.step(step)


@pytest.mark.gcs
@pytest.mark.parametrize("how", ["from_env", "arguments"])
def test_an_unreachable_store_stops_the_checkpointer_before_step_0(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []
    with stopped_gcs_store() as stopped:  # it holds a snapshot at step 7 of this key
        monkeypatch.setenv(EMULATOR, stopped.endpoint)
        monkeypatch.setenv(env.STORE_CONNECT_TIMEOUT.name, "1s")
        monkeypatch.setenv(env.STORE.name, stopped.url)
        monkeypatch.setenv(env.KEY.name, stopped.key)
        factory = (Checkpointer.from_env if how == "from_env"
                   else lambda: Checkpointer(store=stopped.url, key=stopped.key, every_steps=1))
        with pytest.raises(StoreUnreachable, match=f"cannot reach the store {stopped.url}"):
            _train(factory, steps)
    assert steps == []  # no silent fresh start from step 0


BARE_SCRIPT = """
import sys
import torch
from cairn import Checkpointer
ckpt = Checkpointer(store=sys.argv[1], key="bare/script/1", every_steps=1)
print("step", ckpt.restore(model=torch.nn.Linear(2, 1)))
"""


def test_a_bare_script_exits_with_the_store_unreachable_code(tmp_path: Path) -> None:
    """``python train.py`` in a pod or a batch job that lets the error propagate exits 6, as
    ``cairn run`` does for a store it cannot reach, so its exit code tells an outage from a
    bug (1); the message is logged once, without a traceback (issue 34)."""
    (tmp_path / "not-a-volume").write_text("a file where the store's volume should be")
    store = tmp_path / "not-a-volume" / "store"
    done = subprocess.run([sys.executable, "-c", BARE_SCRIPT, str(store)], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == int(ExitCode.STORAGE) == 6, done.stderr
    assert "step" not in done.stdout
    assert done.stderr.count(str(store)) >= 1 and "Traceback" not in done.stderr, done.stderr
