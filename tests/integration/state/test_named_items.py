"""Named state items (``restore(items=...)``): any object with ``state_dict`` /
``load_state_dict`` (torch's ``Stateful``, as torch.distributed.checkpoint takes them) is saved
with every snapshot and loaded on restore, all or nothing, beside the keyword shorthands."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cairn.exceptions import ConfigError
from cairn.state import Checkpointer
from cairn.state.capture import StateMismatch
from cairn.state.checkpointer import load_state
from cairn.store import Store
from tests.support.signals import restore_signal_handlers  # noqa: F401 - autouse

KEY = "dag/train/items/0"


class Ema:
    """An exponential moving average of a model's weights: a tensor and a count."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.updates = 0
        self.reads = 0

    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        for n, p in model.named_parameters():
            self.shadow[n].mul_(0.9).add_(p.detach(), alpha=0.1)

    def state_dict(self) -> dict[str, Any]:
        self.reads += 1
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {n: t.clone() for n, t in state["shadow"].items()}
        self.updates = state["updates"]


class Curriculum:
    def __init__(self) -> None:
        self.stage = "easy"
        self.seen = [1, 2]

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage, self.seen = state["stage"], list(state["seen"])


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(store: Store) -> tuple[torch.nn.Module, Ema, Curriculum]:
    model, opt = _model(0)
    ema, curriculum = Ema(model), Curriculum()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=2, every_seconds=None)
    assert ckpt.restore(model=model, optimizer=opt,
                        items={"ema": ema, "curriculum": curriculum}) == 0
    assert ema.reads == 0  # read when a snapshot is taken, not before
    for step in range(4):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
        curriculum.stage, curriculum.seen = f"stage-{step}", curriculum.seen + [step]
        ckpt.step(step)
    ckpt.close()
    assert ema.reads == 2  # steps 1 and 3
    return model, ema, curriculum


def test_named_items_come_back_with_the_model(store: Store) -> None:
    model, ema, curriculum = _train(store)
    model2, opt2 = _model(7)
    ema2, curriculum2 = Ema(model2), Curriculum()
    again = Checkpointer(store=store, key=KEY)
    assert again.restore(model=model2, optimizer=opt2,
                         items={"curriculum": curriculum2, "ema": ema2}) == 4
    assert torch.equal(model2.weight, model.weight)
    assert ema2.updates == 4 and ema2.shadow.keys() == ema.shadow.keys()
    assert all(torch.equal(ema2.shadow[n], ema.shadow[n]) for n in ema.shadow)
    assert (curriculum2.stage, curriculum2.seen) == ("stage-3", [1, 2, 0, 1, 2, 3])
    again.close()


def test_other_names_are_refused_before_anything_loads(store: Store) -> None:
    _train(store)
    model2, opt2 = _model(7)
    before = model2.weight.detach().clone()
    ema2, extra = Ema(model2), Curriculum()
    with pytest.raises(StateMismatch, match=r"items: the snapshot has \['curriculum', 'ema'\], "
                                            r"you passed \['ema'\]"):
        Checkpointer(store=store, key=KEY).restore(model=model2, optimizer=opt2,
                                                   items={"ema": ema2})
    with pytest.raises(StateMismatch, match="items: the snapshot has"):
        Checkpointer(store=store, key=KEY).restore(model=model2, optimizer=opt2)
    assert torch.equal(model2.weight, before) and ema2.updates == 0 and extra.stage == "easy"


def test_bad_items_are_refused_naming_the_item(local_backend) -> None:  # noqa: ANN001
    from cairn.store import Store as StoreClass

    with StoreClass(local_backend) as store:
        model, opt = _model(0)
        with pytest.raises(ConfigError, match="item 'counter' has no state_dict/load_state_dict"):
            Checkpointer(store=store, key=KEY).restore(model=model, optimizer=opt,
                                                       items={"counter": 3})
        with pytest.raises(ConfigError, match="item's name is empty"):
            Checkpointer(store=store, key=KEY).restore(model=model, optimizer=opt,
                                                       items={"": Curriculum()})
        # Without items a snapshot's tree is laid out as before named items existed.
        ckpt = Checkpointer(store=store, key=KEY)
        ckpt.restore(model=model, optimizer=opt)
        manifest = ckpt.save(0, wait=True)
        ckpt.close()
        assert manifest is not None and "items" not in load_state(store, manifest)
