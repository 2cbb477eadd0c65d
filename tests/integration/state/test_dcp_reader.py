"""torch.distributed.checkpoint reads cairn's state snapshots (ADR 0051): ``dcp.load`` through
:class:`cairn.dcp.StoreReader` fills a state dict bit for bit as the snapshot holds it, never
unpickling, every byte verified first; ``cairn export --dcp`` writes DCP's own layout, which
stock ``dcp.load`` reads back to the same bits."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cairn.dcp
from cairn.cli.main import main as cli_main
from cairn.exceptions import ConfigError, CorruptSnapshot
from cairn.state import Checkpointer
from cairn.state.checkpointer import PersistMode
from cairn.state.checkpointer import load_state
from cairn.store import Key, Store
from tests.support import tamper
from tests.support.signals import restore_signal_handlers  # noqa: F401 - autouse

KEY = "dag/train/dcp/0"


class Counter:
    """A named item whose state is a tensor, a tuple and a numpy array beside plain values."""

    def __init__(self) -> None:
        import numpy as np

        self.state: dict[str, Any] = {"seen": 0, "window": (3, 5), "lr_trace": [0.1, 0.05],
                                      "hist": np.zeros(7, dtype=np.int32),
                                      "pair": (torch.zeros(2), torch.ones(3))}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    # Uneven shapes, a bias and a buffer: what a real model's state dict holds.
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 7)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _snapshot(store: Store) -> dict[str, Any]:
    """Three steps of training, one snapshot after the last; the snapshot's tree as cairn's own
    reader returns it."""
    model, opt, sched = _objects(0)
    counter = Counter()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=3, every_seconds=None,
                        persist=PersistMode.INLINE)
    assert ckpt.restore(model=model, optimizer=opt, scheduler=sched,
                        items={"counter": counter}) == 0
    for step in range(3):
        _train(model, opt, sched, 1)
        counter.state["seen"] += 1
        counter.state["hist"][step] = step + 10
        ckpt.step(step)
    ckpt.close()
    return load_state(store, store.manifest(Key.parse(KEY)))


def _fresh_state_dict() -> dict[str, Any]:
    """What a new run would hand dcp.load: other weights, optimizer state of the same shapes
    (one step of its own), another schedule position."""
    model, opt, sched = _objects(7)
    _train(model, opt, sched, 1)
    return {"models": {"default": model.state_dict()},
            "optimizers": {"default": opt.state_dict()},
            "schedulers": {"default": sched.state_dict()},
            "items": {"counter": {"seen": -1, "window": (0, 0), "lr_trace": [],
                                  "hist": None, "pair": (torch.empty(2), torch.empty(3))}},
            "step": -1}


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    import numpy as np

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, where
        assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert {str(k) for k in got} == {str(k) for k in want}, where
        by_str = {str(k): v for k, v in got.items()}
        for k, v in want.items():
            _assert_same(by_str[str(k)], v, f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want and type(got) is type(want), where


def test_dcp_load_through_the_store_reader_gives_the_snapshot_bit_for_bit(store: Store) -> None:
    saved = _snapshot(store)
    state = _fresh_state_dict()
    manifest = cairn.dcp.load(state, store=store, key=KEY)
    assert manifest.seq == store.manifest(Key.parse(KEY)).seq
    for group in ("models", "optimizers", "schedulers", "items"):
        _assert_same(state[group], saved[group], group)
    assert state["step"] == saved["step"] == 2
    # The loaded state dicts go back into live objects as torch's own ones do.
    model, opt, sched = _objects(9)
    model.load_state_dict(state["models"]["default"])
    opt.load_state_dict(state["optimizers"]["default"])
    sched.load_state_dict(state["schedulers"]["default"])
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and sched.last_epoch == 3


def test_dcp_s_own_call_loads_only_the_keys_asked_for(local_backend) -> None:  # noqa: ANN001
    with Store(local_backend) as store:
        saved = _snapshot(store)
        model, _, _ = _objects(7)
        state = {"models": {"default": model.state_dict()}}
        dcp.load(state, storage_reader=cairn.dcp.StoreReader(store, KEY),
                 planner=cairn.dcp.LoadPlanner())
        _assert_same(state["models"]["default"], saved["models"]["default"])
        assert torch.equal(model[0].weight, saved["models"]["default"]["0.weight"])


def test_dcp_s_default_planner_is_refused_rather_than_unpickling(local_backend) -> None:  # noqa: ANN001
    with Store(local_backend) as store:
        _snapshot(store)
        state = _fresh_state_dict()
        before = state["models"]["default"]["0.weight"].clone()
        with pytest.raises(ConfigError, match=r"would unpickle it; pass planner=cairn.dcp.LoadPlanner"):
            try:
                dcp.load(state, storage_reader=cairn.dcp.StoreReader(store, KEY))
            except dcp.api.CheckpointException as e:
                (failure, _), = e.failures.values()
                raise failure from None
        assert torch.equal(state["models"]["default"]["0.weight"], before)


@pytest.mark.parametrize("path", ["state.json", "tensors/000000"])
def test_a_tampered_snapshot_is_refused_and_nothing_is_loaded(store: Store, path: str) -> None:
    """A byte flipped in the chunk of ``state.json`` (read before DCP plans) or of the first
    weight (read while DCP serves the plan, its failure wrapped by DCP) is the store's verdict,
    CorruptSnapshot, on every backend, encrypted or not."""
    _snapshot(store)
    entry = next(e for e in store.manifest(Key.parse(KEY)).files if e.path == path)
    chunk = entry.chunks[0]
    tamper.flip_byte(store.backend, chunk.pack, chunk.offset + chunk.size // 2)
    state = _fresh_state_dict()
    before = {k: v.clone() for k, v in state["models"]["default"].items()}
    with pytest.raises(CorruptSnapshot):
        cairn.dcp.load(state, store=store, key=KEY)
    _assert_same(state["models"]["default"], before)
    assert state["step"] == -1


def test_the_reader_refuses_a_rank_the_snapshot_does_not_have(local_backend) -> None:  # noqa: ANN001
    with Store(local_backend) as store:
        _snapshot(store)
        with pytest.raises(ConfigError, match=r"taken by 1 rank\(s\); rank= must be 0 to 0, not 1"):
            cairn.dcp.StoreReader(store, KEY, rank=1)
        with pytest.raises(ConfigError, match="make another StoreReader"):
            cairn.dcp.StoreReader(store, KEY).reset("/some/dir")


def test_cairn_export_dcp_writes_what_stock_dcp_load_reads_back(local_backend, tmp_path,
                                                               capsys) -> None:  # noqa: ANN001
    with Store(local_backend) as store:
        saved = _snapshot(store)
    url, dest = local_backend.root, tmp_path / "exported"
    assert cli_main(["export", url, KEY, str(dest)]) == 2  # no layout named
    assert "name the layout to export to: --dcp" in capsys.readouterr().err
    assert cli_main(["export", "--dcp", "-q", url, KEY, str(dest)]) == 0
    assert "exported dag/train/dcp/0 seq" in capsys.readouterr().out
    assert sorted(os.listdir(dest)) == [".metadata", "__0_0.distcp"]
    assert not os.path.exists(f"{dest}.cairn-partial")
    from_files = _fresh_state_dict()
    dcp.load(from_files, checkpoint_id=str(dest))  # stock reader, stock planner
    with Store(local_backend) as store:
        from_store = _fresh_state_dict()
        cairn.dcp.load(from_store, store=store, key=KEY)
    for group in ("models", "optimizers", "schedulers"):
        _assert_same(from_files[group], saved[group], group)
        _assert_same(from_store[group], from_files[group], group)
    assert cli_main(["export", "--dcp", "-q", url, KEY, str(dest)]) == 2  # not empty
    assert "exists and is not an empty directory" in capsys.readouterr().err
