"""Checkpointer semantics: restore returns the next step, all-or-nothing, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from cairn.exceptions import ConfigError, Fenced
from cairn.state import Checkpointer
from cairn.state.capture import StateMismatch
from cairn.state.checkpointer import tensor_path
from cairn.store import Key, Store
from tests.support import tamper

KEY = "dag/train/run-1/0"


def make(seed: int = 0, hidden: int = 8):  # noqa: ANN201
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def train_step(model, opt) -> None:  # noqa: ANN001
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_fresh_start_then_resume_from_last_snapshot(store: Store) -> None:
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=3, every_seconds=None)
    assert ckpt.restore(model=model, optimizer=opt) == 0
    saved = []
    for step in range(7):
        train_step(model, opt)
        if ckpt.step(step):
            saved.append(step)
    assert saved == [2, 5]
    ckpt.extras["note"] = "hello"
    ckpt.save(6)
    model2, opt2 = make(seed=99)
    again = Checkpointer(store=store, key=KEY)
    assert again.restore(model=model2, optimizer=opt2) == 7
    assert again.extras == {"note": "hello"}
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["momentum_buffer"].shape == (8, 4)


def test_corrupt_newest_falls_back_and_never_loads_it(store: Store) -> None:
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=1, every_seconds=None)
    ckpt.restore(model=model, optimizer=opt)
    train_step(model, opt)
    ckpt.step(0)
    good = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt)
    newest = ckpt.save(1)
    chunk = newest.file(tensor_path(0)).chunks[0]
    tamper.flip_byte(store.backend, chunk.pack, chunk.offset)
    model2, opt2 = make(seed=5)
    assert Checkpointer(store=store, key=KEY).restore(model=model2, optimizer=opt2) == 1
    for a, b in zip(good, model2.parameters()):
        assert torch.equal(a, b)


def test_changed_architecture_is_refused_before_anything_loads(store: Store) -> None:
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY)
    ckpt.restore(model=model, optimizer=opt)
    ckpt.save(0)
    bigger, bigger_opt = make(seed=3, hidden=16)
    before = [p.detach().clone() for p in bigger.parameters()]
    with pytest.raises(StateMismatch, match=r"snapshot \(8, 4\).*live \(16, 4\)"):
        Checkpointer(store=store, key=KEY).restore(model=bigger, optimizer=bigger_opt)
    for a, b in zip(before, bigger.parameters()):
        assert torch.equal(a, b)


def test_plain_dataloader_is_refused_naming_the_fix(store: Store) -> None:
    model, opt = make()
    loader = DataLoader(list(range(10)))
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        Checkpointer(store=store, key=KEY).restore(model=model, optimizer=opt, loader=loader)


def test_fenced_checkpointer_raises_on_step(store: Store) -> None:
    model, opt = make()
    zombie = Checkpointer(store=store, key=KEY, every_steps=1, every_seconds=None)
    zombie.restore(model=model, optimizer=opt)
    Checkpointer(store=store, key=KEY).restore(model=model, optimizer=opt)  # the retry
    with pytest.raises(Fenced):
        zombie.step(0)


def test_from_env(monkeypatch: pytest.MonkeyPatch, backend_url: str) -> None:
    monkeypatch.delenv("CAIRN_STORE", raising=False)
    with pytest.raises(ConfigError, match="CAIRN_STORE and CAIRN_KEY"):
        Checkpointer.from_env()
    monkeypatch.setenv("CAIRN_STORE", backend_url)
    monkeypatch.setenv("CAIRN_KEY", KEY)
    monkeypatch.setenv("CAIRN_EVERY_STEPS", "4")
    ckpt = Checkpointer.from_env()
    assert ckpt.key == Key.parse(KEY) and ckpt.policy.every_steps == 4
    ckpt.close()


def test_step_before_restore_is_an_error(store: Store) -> None:
    with pytest.raises(ConfigError, match="call restore"):
        Checkpointer(store=store, key=KEY).step(0)
