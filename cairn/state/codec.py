"""The state format: a JSON tree plus raw tensor bytes with a typed header. No pickle.

:func:`flatten` turns a state tree — dicts (str, int, float, bool or None keys), lists,
tuples, ``None``, booleans, numbers, strings, torch tensors and numpy arrays — into a JSON-able
structure in which every array is replaced by its index in a separate list of arrays.
:func:`unflatten` reverses it. Containers are tagged (``{"$dict": [[k, v], ...]}``) so that
integer keys (optimizer state) and tuples (Adam's betas, RNG states) come back as they were.
A sharded tensor (a DTensor: FSDP2's parameters and optimizer moments) is stored as this rank's
local piece with the global shape and the piece's offsets in it (``{"$shard": [index, shape,
offsets]}``), and comes back as a :class:`Shard`.

Each array is stored as its raw bytes in C order, described by a :class:`ArrayHeader`
(kind, dtype, shape, nbytes). Decoding checks that the byte count matches the header before
anything is built from the bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cairn.exceptions import ConfigError, CorruptSnapshot

STATE_SCHEMA = "cairn.state/1"
STATE_FILE = "state.json"


def tensor_path(index: int) -> str:
    """Where array ``index`` of a state snapshot is stored."""
    return f"tensors/{index:06d}"

# torch dtypes by the name we store; numpy dtypes are stored as numpy's own str (e.g. "<u4").
_TORCH_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "bool",
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)
_NUMPY_KINDS = frozenset("biufc")


@dataclass(frozen=True)
class ArrayHeader:
    """What a stored array is: ``kind`` "torch" or "numpy", its dtype name, shape and size."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, doc: Any) -> ArrayHeader:
        try:
            kind, dtype = str(doc["kind"]), str(doc["dtype"])
            shape = tuple(int(d) for d in doc["shape"])
            nbytes = int(doc["nbytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshot(f"bad array header {doc!r}: {e}") from None
        if kind == "torch" and dtype not in _TORCH_DTYPES:
            raise CorruptSnapshot(f"unknown torch dtype {dtype!r} (upgrade cairn?)")
        if kind == "numpy":
            try:
                if np.dtype(dtype).kind not in _NUMPY_KINDS:
                    raise TypeError
            except TypeError:
                raise CorruptSnapshot(f"unsupported numpy dtype {dtype!r}") from None
        elif kind != "torch":
            raise CorruptSnapshot(f"unknown array kind {kind!r}")
        if any(d < 0 for d in shape) or nbytes < 0:
            raise CorruptSnapshot(f"negative shape or size in {doc!r}")
        return cls(kind, dtype, shape, nbytes)


@dataclass(frozen=True)
class Shard:
    """One rank's piece of a sharded tensor: the ``local`` tensor, the global tensor's
    ``shape`` and the piece's ``offsets`` in it (DCP's chunk of it)."""

    local: Any
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def shards_in(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Shard]]:
    """Every :class:`Shard` of a decoded ``tree`` with its path of keys."""
    if isinstance(tree, Shard):
        return [(path, tree)]
    if isinstance(tree, dict):
        return [found for key, value in tree.items() for found in shards_in(value, (*path, key))]
    return []


_ARRAY_TAGS = ("$tensor", "$ndarray", "$shard")


def array_indices(structure: Any, *, tags: tuple[str, ...] = _ARRAY_TAGS) -> set[int]:
    """The array indices :func:`flatten`'s ``structure`` refers to under ``tags`` (default:
    every array; ``("$shard",)``: the sharded tensors' pieces). Parsed JSON, not yet trusted:
    anything unexpected is left for :func:`unflatten`."""
    found: set[int] = set()
    stack = [structure]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if len(value) == 1 and next(iter(value)) in _ARRAY_TAGS:
                tag, body = next(iter(value.items()))
                index = body[0] if tag == "$shard" and isinstance(body, list) and body else body
                if tag in tags and isinstance(index, int):
                    found.add(index)
            else:
                stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


def shards_filled(tree: Any, dest: Any) -> Any:
    """``tree`` with each :class:`Shard` replaced by the value at the same path in ``dest``
    (a tree of dicts holding a value for every shard)."""
    if isinstance(tree, Shard):
        return dest
    if isinstance(tree, dict) and isinstance(dest, dict):
        return {k: shards_filled(v, dest[k]) if k in dest else v for k, v in tree.items()}
    return tree


def _torch() -> Any:
    import torch

    return torch


def _is_tensor(value: object) -> bool:
    torch = _torch_if_loaded()
    return torch is not None and isinstance(value, torch.Tensor)


def _is_dtensor(value: object) -> bool:
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _shard_of(value: Any) -> Shard:
    # DCP's own view of a DTensor's piece (the protocol dcp.save asks it through).
    chunks = value.__create_chunk_list__()
    if len(chunks) != 1:
        raise ConfigError(f"a DTensor of {len(chunks)} chunks on one rank cannot be stored")
    return Shard(local=value.to_local(), shape=tuple(value.shape),
                 offsets=tuple(int(o) for o in chunks[0].offsets))


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


def flatten(tree: Any, *, where: str = "state") -> tuple[Any, list[Any]]:
    """``(structure, arrays)``: a JSON-able structure and the tensors/ndarrays it refers to."""
    arrays: list[Any] = []
    return _encode(tree, arrays, where), arrays


def _encode(value: Any, arrays: list[Any], where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": repr(value)}  # JSON has no NaN or infinity
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not (key is None or isinstance(key, (str, int, float, bool))):
                raise ConfigError(f"{where}: dict key {key!r} is a {type(key).__name__}; "
                                  "keys must be str, int, float, bool or None")
            items.append([_encode(key, arrays, where), _encode(item, arrays, f"{where}[{key!r}]")])
        return {"$dict": items}
    if isinstance(value, list):
        return {"$list": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, Shard) or _is_dtensor(value):
        shard = value if isinstance(value, Shard) else _shard_of(value)
        arrays.append(shard.local)
        return {"$shard": [len(arrays) - 1, list(shard.shape), list(shard.offsets)]}
    if _is_tensor(value):
        arrays.append(value)
        return {"$tensor": len(arrays) - 1}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMPY_KINDS:
            raise ConfigError(f"{where}: numpy arrays of dtype {value.dtype} cannot be stored; "
                              "use numeric or boolean arrays")
        arrays.append(value)
        return {"$ndarray": len(arrays) - 1}
    if isinstance(value, np.generic):
        return _encode(value.item(), arrays, where)
    raise ConfigError(f"{where} is a {type(value).__name__}, which a snapshot cannot hold without "
                      "pickle; store JSON-able values (numbers, strings, lists, dicts) or tensors")


def unflatten(structure: Any, arrays: list[Any]) -> Any:
    """Rebuild the tree from :func:`flatten`'s structure and the decoded arrays."""
    try:
        return _decode(structure, arrays)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise CorruptSnapshot(f"state structure is malformed: {e}") from None


def _decode(value: Any, arrays: list[Any]) -> Any:
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, body), = value.items()
        if tag == "$dict":
            return {_decode(k, arrays): _decode(v, arrays) for k, v in body}
        if tag == "$list":
            return [_decode(v, arrays) for v in body]
        if tag == "$tuple":
            return tuple(_decode(v, arrays) for v in body)
        if tag in ("$tensor", "$ndarray"):
            return arrays[int(body)]
        if tag == "$shard":
            index, shape, offsets = body
            shape, offsets = tuple(int(d) for d in shape), tuple(int(o) for o in offsets)
            if len(shape) != len(offsets) or any(o < 0 for o in offsets):
                raise ValueError(f"bad shard {body!r}")
            return Shard(local=arrays[int(index)], shape=shape, offsets=offsets)
        if tag == "$float":
            if body not in ("nan", "inf", "-inf"):
                raise ValueError(f"bad float {body!r}")
            return float(body)
    raise ValueError(f"unexpected element {value!r}")


def header_of(array: Any) -> ArrayHeader:
    if isinstance(array, np.ndarray):
        return ArrayHeader("numpy", array.dtype.str, tuple(array.shape), int(array.nbytes))
    dtype = str(array.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise ConfigError(f"torch dtype {dtype} is not supported in snapshots")
    return ArrayHeader("torch", dtype, tuple(array.shape), array.numel() * array.element_size())


def cpu_bytes(array: Any) -> memoryview:
    """The array's raw bytes in C order, as a read-only view (a CPU copy for device tensors)."""
    if isinstance(array, np.ndarray):
        return memoryview(np.ascontiguousarray(array)).cast("B")
    tensor = array.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous().reshape(-1)
    if tensor.numel() == 0:
        return memoryview(b"")
    torch = _torch()
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def array_from_bytes(header: ArrayHeader, data: bytes | bytearray | memoryview) -> Any:
    """Build a CPU tensor or ndarray from verified bytes; checks the size against the header.

    A ``bytearray`` is used in place (the result shares its memory; do not reuse it).
    """
    if len(data) != header.nbytes:
        raise CorruptSnapshot(f"array of {header.shape} {header.dtype} needs {header.nbytes} "
                              f"bytes, got {len(data)}")
    # A bytearray is owned by the caller and handed over; anything else is copied once.
    owned = data if isinstance(data, bytearray) else bytearray(data)
    if header.kind == "numpy":
        arr = np.frombuffer(owned, dtype=np.dtype(header.dtype))
        return arr.reshape(header.shape)
    torch = _torch()
    dtype = getattr(torch, header.dtype)
    numel = math.prod(header.shape)
    if numel * torch.empty((), dtype=dtype).element_size() != header.nbytes:
        raise CorruptSnapshot(f"header {header} is inconsistent: shape and dtype do not make "
                              f"{header.nbytes} bytes")
    if numel == 0:
        return torch.empty(header.shape, dtype=dtype)
    raw = torch.frombuffer(owned, dtype=torch.uint8)
    return raw.view(dtype).reshape(header.shape)


VALUE_SCHEMA = "cairn.value/1"


def encode_value(value: Any) -> bytes:
    """One value as self-contained bytes: a line of JSON (the structure, the arrays' headers),
    then each array's raw bytes in order. For values handed across an interface that takes
    bytes (torch.distributed.checkpoint's), never pickled; :func:`decode_value` reverses it."""
    structure, arrays = flatten(value, where="value")
    head = {"schema": VALUE_SCHEMA, "structure": structure,
            "arrays": [header_of(a).to_json() for a in arrays]}
    # json.dumps escapes every newline inside strings, so the first b"\n" ends the head.
    return b"".join([json.dumps(head, separators=(",", ":")).encode(), b"\n",
                     *(bytes(cpu_bytes(a)) for a in arrays)])


def decode_value(data: bytes) -> Any:
    """The value :func:`encode_value` encoded; CorruptSnapshot when the bytes are not one."""
    line, sep, body = data.partition(b"\n")
    try:
        head = json.loads(line)
        if not sep or head.get("schema") != VALUE_SCHEMA:
            raise ValueError(f"not a {VALUE_SCHEMA} value")
        headers = [ArrayHeader.from_json(h) for h in head["arrays"]]
        structure = head["structure"]
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise CorruptSnapshot(f"an encoded value is unreadable: {e}") from None
    arrays, offset = [], 0
    for header in headers:
        arrays.append(array_from_bytes(header, body[offset:offset + header.nbytes]))
        offset += header.nbytes
    if offset != len(body):
        raise CorruptSnapshot(f"an encoded value has {len(body) - offset} bytes past its arrays")
    return unflatten(structure, arrays)
