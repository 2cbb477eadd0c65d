"""The state format round-trips every kind of value training state holds, without pickle."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from cairn.exceptions import ConfigError, CorruptSnapshot
from cairn.state.codec import ArrayHeader, array_from_bytes, cpu_bytes, flatten, header_of, unflatten


def round_trip(tree: object) -> object:
    structure, arrays = flatten(tree)
    structure = json.loads(json.dumps(structure, allow_nan=False))  # strict JSON
    headers = [ArrayHeader.from_json(json.loads(json.dumps(header_of(a).to_json()))) for a in arrays]
    return unflatten(structure, [array_from_bytes(h, bytes(cpu_bytes(a))) for h, a in zip(headers, arrays)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.uint8, torch.bool, torch.complex64, torch.float64])
def test_tensors_of_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5) * 10).to(dtype)
    out = round_trip({"t": t, "scalar": t[0, 0].clone(), "empty": torch.empty(0, 4, dtype=dtype)})
    assert torch.equal(out["t"], t) and out["t"].dtype == dtype
    assert out["scalar"].shape == () and torch.equal(out["scalar"], t[0, 0])
    assert out["empty"].shape == (0, 4)


def test_non_contiguous_tensor_is_stored_in_c_order() -> None:
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(round_trip([t])[0], t)


def test_optimizer_state_and_rng_states() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    tree = {"opt": opt.state_dict(), "py": random.getstate(), "np": np.random.get_state(),
            "torch": torch.get_rng_state(), "inf": math.inf, "nan": math.nan, "none": None}
    out = round_trip(tree)
    assert set(out["opt"]["state"]) == {0, 1}  # int keys survive
    assert out["opt"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples survive
    assert torch.equal(out["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert out["py"] == tree["py"]
    assert out["np"][0] == "MT19937" and np.array_equal(out["np"][1], tree["np"][1])
    assert torch.equal(out["torch"], tree["torch"])
    assert out["inf"] == math.inf and math.isnan(out["nan"]) and out["none"] is None


@pytest.mark.parametrize("value, message", [
    (object(), "cannot hold without pickle"),
    ({(1, 2): 3}, "dict key"),
    (np.array(["a"]), "numpy arrays of dtype"),
])
def test_unstorable_values_name_the_fix(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        flatten({"extras": {"x": value}})


@pytest.mark.parametrize("doc", [
    {"kind": "torch", "dtype": "float32", "shape": [2], "nbytes": 4},
    {"kind": "torch", "dtype": "evil", "shape": [1], "nbytes": 4},
    {"kind": "pickle", "dtype": "float32", "shape": [1], "nbytes": 4},
    {"kind": "numpy", "dtype": "O", "shape": [1], "nbytes": 8},
    {"kind": "torch", "dtype": "float32", "shape": [-1], "nbytes": 4},
])
def test_bad_headers_are_corrupt(doc: dict) -> None:
    with pytest.raises(CorruptSnapshot):
        array_from_bytes(ArrayHeader.from_json(doc), b"\0" * 4)


def test_malformed_structure_is_corrupt() -> None:
    with pytest.raises(CorruptSnapshot):
        unflatten({"$tensor": 3}, [])
    with pytest.raises(CorruptSnapshot):
        unflatten({"$float": "1e999"}, [])


def test_a_value_encodes_to_bytes_and_back_without_pickle() -> None:
    import numpy as np

    from cairn.state.codec import decode_value, encode_value

    value = {"lr": 0.1, "betas": (0.9, 0.999), "name": "line\nbreak", "none": None,
             "moments": (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.ones(0)),
             "hist": np.arange(4, dtype=np.int16), 3: [float("inf"), True]}
    data = encode_value(value)
    assert b"pickle" not in data and data.split(b"\n", 1)[0].startswith(b"{")
    back = decode_value(data)
    assert back.keys() == value.keys() and back["betas"] == (0.9, 0.999)
    assert back["name"] == "line\nbreak" and back[3] == [float("inf"), True]
    assert torch.equal(back["moments"][0], value["moments"][0])
    assert back["moments"][0].dtype == torch.bfloat16 and back["moments"][1].shape == (0,)
    assert back["hist"].dtype == np.int16 and back["hist"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("data", [b"", b"\x80\x04K\x01.", b'{"schema":"cairn.value/1"}',
                                  b'{"schema":"other","structure":1,"arrays":[]}\n',
                                  b'{"schema":"cairn.value/1","structure":1,"arrays":[]}\nextra',
                                  b'{"schema":"cairn.value/1","structure":{"$tensor":0},"arrays":'
                                  b'[{"kind":"torch","dtype":"float32","shape":[2],"nbytes":8}]}\n'
                                  b'1234'])
def test_bytes_that_are_not_an_encoded_value_are_refused(data: bytes) -> None:
    from cairn.state.codec import decode_value

    with pytest.raises(CorruptSnapshot):
        decode_value(data)


def test_a_shard_round_trips_as_its_piece_and_a_malformed_one_is_corrupt() -> None:
    from cairn.state.codec import Shard, shards_filled, shards_in

    piece = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    tree = {"models": {"m": {"w": Shard(local=piece, shape=(5, 3), offsets=(2, 0))}}, "step": 1}
    structure, arrays = flatten(tree)
    assert len(arrays) == 1 and arrays[0] is piece  # the piece is stored, not a gathered whole
    back = unflatten(structure, arrays)
    [(path, shard)] = shards_in(back)
    assert path == ("models", "m", "w") and shard.shape == (5, 3) and shard.offsets == (2, 0)
    assert torch.equal(shard.local, piece)
    whole = torch.zeros(5, 3)
    filled = shards_filled(back, {"models": {"m": {"w": whole}}})
    assert filled["models"]["m"]["w"] is whole and filled["step"] == 1
    for bad in ([0, [5, 3], [2]], [0, [5, 3], [-1, 0]]):
        with pytest.raises(CorruptSnapshot, match="malformed"):
            unflatten({"$shard": bad}, arrays)
