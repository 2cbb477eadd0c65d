"""A state restore from a local store reads the tensors' bytes with O_DIRECT into page-aligned
memory of their own: the packs stay out of the page cache, and the optimizer state that
lives on in that memory trains on exactly as the original."""

from __future__ import annotations

import os

import pytest
import torch

from cairn.state import Checkpointer
from cairn.store import Store, StoreSettings
from cairn import open_store
from tests.support.pagecache import evict, pack_files, require_page_cache, resident_pages

KEY = "dag/train/run-1/0"


def make(seed: int):  # noqa: ANN201
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 64))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model, opt, seed: int) -> None:  # noqa: ANN001
    torch.manual_seed(seed)
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture()
def local_store(tmp_path) -> Store:  # noqa: ANN001
    require_page_cache(str(tmp_path))
    store = open_store(str(tmp_path / "store"), settings=StoreSettings())
    yield store
    store.close()


def test_restore_bypasses_the_page_cache_and_training_goes_on_identically(
        local_store: Store) -> None:
    model, opt = make(0)
    ckpt = Checkpointer(store=local_store, key=KEY, every_steps=10**6, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    for step in range(3):
        train_step(model, opt, step)
    manifest = ckpt.save(2, wait=True)
    ckpt.close()
    assert manifest is not None
    packs = pack_files(local_store, manifest)
    for path in packs:
        evict(path)

    model2, opt2 = make(1)
    again = Checkpointer(store=local_store, key=KEY, every_steps=10**6, preemption=None)
    assert again.restore(model=model2, optimizer=opt2) == 3
    again.close()
    stored = sum(os.path.getsize(p) for p in packs)
    cached = sum(resident_pages(p) for p in packs) * 4096
    assert cached < stored / 10, (cached, stored)  # state.json and small tensors only

    exp_avg = opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"]
    assert exp_avg.data_ptr() % 4096 == 0  # its own page-aligned memory, read into directly
    for step in range(3, 6):
        train_step(model, opt, step)
        train_step(model2, opt2, step)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_out_of_mappings_falls_back_to_ordinary_memory(
        local_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulates a process at vm.max_map_count: every new mapping fails with ENOMEM.
    import errno

    model, opt = make(0)
    ckpt = Checkpointer(store=local_store, key=KEY, every_steps=10**6, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    train_step(model, opt, 0)
    ckpt.save(0, wait=True)
    ckpt.close()

    def no_mappings(nbytes: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr("cairn.state.state_io.aligned_buffer", no_mappings)
    model2, opt2 = make(1)
    again = Checkpointer(store=local_store, key=KEY, every_steps=10**6, preemption=None)
    assert again.restore(model=model2, optimizer=opt2) == 1
    again.close()
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    exp_avg = opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"]
    assert torch.equal(exp_avg, opt.state[opt.param_groups[0]["params"][0]]["exp_avg"])
