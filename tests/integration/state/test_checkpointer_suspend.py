"""Checkpointer and suspend requests in one process: a final snapshot that cannot be taken now
is tried at the next step, a held key opens no attempt, a resume before the step cancels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cairn.exceptions import StoreError, Suspended
from cairn.runtime.exits import ExitCode
from cairn.state import Checkpointer
from cairn.state.checkpointer import PersistMode
from cairn.store import Key
from cairn import open_store
from cairn.store.outcomes import OutcomeKind

KEY = Key.parse("dag/train/run-1/0")


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _checkpointer(store) -> Checkpointer:  # noqa: ANN001 - a Store
    # An hour between polls: the first step reads the store, later steps keep what it read.
    return Checkpointer(store=store, key=KEY, every_steps=100, every_seconds=None,
                        persist=PersistMode.INLINE, suspend_poll_seconds=3600)


def test_a_failed_final_snapshot_is_tried_again_and_a_held_key_opens_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(str(tmp_path / "store"))
    model, opt = _trained()
    ckpt = _checkpointer(store)
    ckpt.restore(model=model, optimizer=opt)
    store.records.request_suspend(KEY, by="ops@example", reason="urgent job")
    real_save, calls = ckpt.save, []

    def fails_once(step: int, **kw: object):  # noqa: ANN202
        calls.append(step)
        if len(calls) == 1:
            raise StoreError("bucket unreachable")
        return real_save(step, **kw)

    monkeypatch.setattr(ckpt, "save", fails_once)
    assert ckpt.step(0) is False, "no snapshot: training goes on"
    with pytest.raises(Suspended) as raised:
        ckpt.step(1)
    assert calls == [0, 1]
    assert raised.value.code == ExitCode.SUSPENDED
    assert raised.value.seq == store.manifest(KEY).seq and store.manifest(KEY).step == 1
    (outcome,) = store.records.outcomes(KEY)
    assert outcome.outcome is OutcomeKind.SUSPENDED and outcome.progress.kept_step == 1
    assert outcome.detail["suspend"]["reason"] == "urgent job"
    ckpt.close()

    seqs = store.log(KEY).seqs()
    held = _checkpointer(store)
    with pytest.raises(Suspended, match="is suspended"):
        held.restore(model=model, optimizer=opt)
    held.close()
    assert store.log(KEY).seqs() == seqs, "no attempt was opened"
    store.close()


def test_a_resume_before_the_next_step_cancels_the_suspend(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"))
    model, opt = _trained()
    ckpt = _checkpointer(store)
    ckpt.restore(model=model, optimizer=opt)
    store.records.request_suspend(KEY)
    store.records.request_resume(KEY)
    assert ckpt.step(0) is False
    assert store.records.outcomes(KEY) == [] and store.snapshots(KEY) == []
    ckpt.close()
    store.close()
