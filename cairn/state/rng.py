"""The global random number generators a training process draws from, as a snapshot tree.

:func:`capture` returns torch's CPU (and, once initialised, CUDA) generator states, numpy's
legacy global ``RandomState`` and Python's ``random`` as a tree that :mod:`cairn.state.codec`
stores without pickle: torch states are uint8 tensors, numpy's is its key array plus JSON
numbers, Python's is a JSON list of ints. :func:`restore` puts such a tree back; it also
accepts the tuple form that snapshots written before this module hold.

numpy's ``default_rng()`` generators and other private generators are not global state: an
object that owns one must save it itself (``state_dict``), as a dataset can.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import blake3
import numpy as np

from cairn.exceptions import CorruptSnapshot

__all__ = ["capture", "check", "derived", "restore"]


def capture(*, cuda: bool = True) -> dict[str, Any]:
    """This process's global RNG states (CUDA only if torch initialised it and ``cuda``)."""
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": np.array(keys, dtype=np.uint32), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def derived(state: dict[str, Any], *, rank: int) -> dict[str, Any]:
    """The RNG states of a rank that a resized restore adds (issue 35): one 64-bit seed, the
    first 8 bytes (little-endian) of the BLAKE3 of ``state``'s torch CPU generator bytes
    followed by ``rank`` as 8 little-endian bytes, seeds torch's CPU generator
    (``manual_seed``), numpy's legacy global one (``RandomState(seed % 2**32)``) and Python's
    ``random`` (``Random(seed)``). The same ``state`` and rank give the same states on every
    run; different ranks, different ones. CUDA generators are left as the process started
    them."""
    import torch

    _parse(state)
    source = state["torch"].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    digest = blake3.blake3(source + int(rank).to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little")
    generator = torch.Generator()
    generator.manual_seed(seed)
    kind, keys, pos, has_gauss, cached = np.random.RandomState(seed % 2**32).get_state(
        legacy=True)
    version, internal, gauss_next = random.Random(seed).getstate()
    return {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {"kind": kind, "keys": np.array(keys, dtype=np.uint32), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": generator.get_state(),
        "cuda": [],
    }


def check(state: Any) -> None:
    """Raise CorruptSnapshot unless ``state`` is a tree :func:`restore` can put back (so a
    restore can refuse a snapshot before it loads anything)."""
    _parse(state)


def _parse(state: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
    try:
        python, numpy = _python_state(state["python"]), _numpy_state(state["numpy"])
        if len(numpy) != 5 or len(numpy[1]) != 624 or len(python) != 3:
            raise ValueError("unexpected numpy or Python state size")
        generator = state["torch"]
        if getattr(generator, "dtype", None) is None:
            raise TypeError("the torch state is not a tensor")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptSnapshot(f"the snapshot's RNG state is malformed: {e}") from None
    return python, numpy, generator


def restore(state: dict[str, Any]) -> None:
    """Set the global RNGs to ``state`` (from :func:`capture`). Raises CorruptSnapshot."""
    import torch

    python, numpy, generator = _parse(state)
    try:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(generator)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CorruptSnapshot(f"the snapshot's RNG state is malformed: {e}") from None
    cuda = state.get("cuda") or []
    if cuda and "torch.cuda" in sys.modules and torch.cuda.is_available():
        for index, cuda_state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


def _python_state(value: Any) -> tuple[Any, ...]:
    if isinstance(value, dict):
        return (int(value["version"]), tuple(int(v) for v in value["state"]),
                None if value["gauss_next"] is None else float(value["gauss_next"]))
    return _tuples(value)  # the tuple random.getstate() returns, as older snapshots hold it


def _numpy_state(value: Any) -> tuple[Any, ...]:
    if isinstance(value, dict):
        return (str(value["kind"]), np.asarray(value["keys"], dtype=np.uint32),
                int(value["pos"]), int(value["has_gauss"]), float(value["cached_gaussian"]))
    return tuple(value)


def _tuples(value: Any) -> Any:
    # random.setstate wants tuples all the way down.
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value
