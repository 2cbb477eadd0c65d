"""cairn.state.rng round-trips through the snapshot codec (JSON plus raw arrays, no pickle),
and cairn.state.loader_workers names each loader that cannot resume bit-identically."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from cairn.state import loader_workers, rng  # noqa: E402
from cairn.state.codec import array_from_bytes, cpu_bytes, flatten, header_of, unflatten  # noqa: E402


def draws() -> tuple[list[float], list[float], list[float]]:
    return (torch.randn(4).tolist(), np.random.normal(size=4).tolist(),
            [random.gauss(0.0, 1.0) for _ in range(4)])


def test_rng_states_survive_the_snapshot_codec() -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    random.gauss(0.0, 1.0)  # and in Python's
    structure, arrays = flatten(rng.capture())
    stored = json.loads(json.dumps(structure))  # the JSON part really is JSON
    decoded = [array_from_bytes(header_of(a), bytes(cpu_bytes(a))) for a in arrays]
    want = draws()
    rng.restore(unflatten(stored, decoded))
    assert draws() == want


def test_rng_restores_the_tuple_form_of_older_snapshots() -> None:
    random.seed(5)
    np.random.seed(5)
    old = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state(), "cuda": []}
    want = draws()
    rng.restore(old)
    assert draws() == want


class Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):  # noqa: ANN204
        yield from range(8)


def test_a_loader_that_cannot_save_its_position_is_named() -> None:
    reasons = loader_workers.diagnose(torch.utils.data.DataLoader(Items()), None)
    assert len(reasons) == 1 and "DataLoader cannot save its position" in reasons[0]


def test_a_sampler_with_hidden_state_is_named() -> None:
    loader = StatefulDataLoader(Items(), sampler=torch.utils.data.RandomSampler(Items()))
    reasons = loader_workers.diagnose(loader, loader.state_dict())
    assert len(reasons) == 1 and "sampler RandomSampler has no state_dict" in reasons[0]


def test_an_iterable_dataset_without_state_is_named() -> None:
    reasons = loader_workers.diagnose(StatefulDataLoader(Stream()), None)
    assert len(reasons) == 1 and "IterableDataset Stream saves no state" in reasons[0]


def test_a_shuffled_stateful_loader_is_exact() -> None:
    assert loader_workers.diagnose(StatefulDataLoader(Items(), shuffle=True), None) == []


def test_workers_started_without_the_hook_are_named() -> None:
    loader = StatefulDataLoader(Items(), num_workers=1)  # no install(): workers save no RNGs
    state = loader.state_dict()
    del loader
    hooked = StatefulDataLoader(Items(), num_workers=1)
    assert loader_workers.install(hooked)
    reasons = loader_workers.diagnose(hooked, state)
    assert len(reasons) == 1 and "no RNG state for the DataLoader workers" in reasons[0]
    assert loader_workers.diagnose(hooked, hooked.state_dict()) == []  # hooked workers do


def test_install_keeps_the_users_worker_init_fn_and_is_idempotent() -> None:
    def mine(worker_id: int) -> None:
        pass

    loader = StatefulDataLoader(Items(), num_workers=1, worker_init_fn=mine)
    assert loader_workers.install(loader) and loader_workers.install(loader)
    assert isinstance(loader.worker_init_fn, loader_workers.WorkerRNG)
    assert loader.worker_init_fn.previous is mine
    assert not loader_workers.install(StatefulDataLoader(Items()))  # no workers: nothing to do


def test_a_malformed_rng_state_is_refused_before_anything_is_set() -> None:
    from cairn.exceptions import CorruptSnapshot

    good = rng.capture()
    torch.manual_seed(9)
    before = torch.get_rng_state()
    bad = dict(good, numpy=dict(good["numpy"], keys=np.zeros(3, dtype=np.uint32)))
    with pytest.raises(CorruptSnapshot, match="RNG state is malformed"):
        rng.restore(bad)
    assert torch.equal(torch.get_rng_state(), before)  # nothing was set
    with pytest.raises(CorruptSnapshot):
        rng.check({"python": good["python"]})
    rng.check(good)
