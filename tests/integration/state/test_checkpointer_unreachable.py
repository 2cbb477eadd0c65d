"""The Checkpointer raises before training when its store cannot be reached (ADR 0032)."""

from __future__ import annotations

import pytest
import torch

from cairn.exceptions import StoreUnreachable
from cairn.runtime import env
from cairn.state import Checkpointer
from tests.support.stopped_gcs import EMULATOR, stopped_gcs_store

pytestmark = pytest.mark.gcs


def _train(ckpt_factory, steps: list[int]) -> None:  # noqa: ANN001 - a callable
    """What a training script does: open, restore, then train from the step it returns."""
    model = torch.nn.Linear(2, 1)
    ckpt = ckpt_factory()
    for step in range(ckpt.restore(model=model), 3):
        steps.append(step)
        ckpt.step(step)


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
