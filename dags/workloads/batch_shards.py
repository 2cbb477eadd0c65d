"""Batch inference over numbered shards, each output committed exactly once (not a DAG file).

``dags/batch_inference.py`` runs :func:`run_shards` in a ``@task.cairn`` task. The "model" is
a fixed-seed ``torch.nn.Linear`` and shard ``i``'s input is generated from ``i`` alone, so
every prediction can be recomputed anywhere (tests do).

Exactly once: shard ``i``'s output is committed create-only to the store as
``outputs/<key path>/shard-<i>.bin``, then the cursor (the next shard) goes into the
Checkpointer's ``extras`` and is snapshotted. A retry restores the cursor and carries on from
there; an output that an earlier try committed after its last cursor snapshot (it was killed
between the two) already exists, so it is kept and counted as reused, never written again.

An output is one line of JSON (``format``, ``shard``, ``dtype``, ``shape``), a newline, then
the predictions' raw little-endian bytes, row-major: no pickle. :func:`decode` and
:func:`check_outputs` need neither torch nor numpy.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

FORMAT = "cairn-batch-shard/1"
ROWS = 64  # inputs per shard
IN_FEATURES = 16
OUT_FEATURES = 4
MODEL_SEED = 1234
INPUT_SEED = 10_000  # shard i's inputs come from seed INPUT_SEED + i


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def output_prefix(key: Any) -> str:
    """Where a key's outputs live in the store: ``outputs/<key path>/``."""
    return f"outputs/{key.path}/"


def build_model() -> Any:
    """The fixed-seed model (the same weights in every process)."""
    import torch

    generator = torch.Generator().manual_seed(MODEL_SEED)
    model = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)
    with torch.no_grad():
        model.weight.copy_(torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator))
        model.bias.copy_(torch.randn(OUT_FEATURES, generator=generator))
    return model.eval()


def shard_inputs(index: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(INPUT_SEED + index)
    return torch.randn(ROWS, IN_FEATURES, generator=generator)


def encode(index: int, predictions: Any) -> bytes:
    """One output object: a JSON header line, then the raw float32 bytes."""
    import torch

    array = predictions.detach().to(torch.float32).contiguous().numpy()
    header = {"format": FORMAT, "shard": index, "dtype": "<f4", "shape": list(array.shape)}
    line = json.dumps(header, separators=(",", ":")).encode()
    return line + b"\n" + array.astype("<f4").tobytes()


def decode(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and the raw bytes of one output; ValueError if they do not match."""
    line, sep, payload = data.partition(b"\n")
    if not sep:
        raise ValueError("not a batch shard output: no header line")
    header = json.loads(line)
    if header.get("format") != FORMAT or header.get("dtype") != "<f4":
        raise ValueError(f"not a batch shard output: header {header}")
    count = 1
    for n in header["shape"]:
        count *= int(n)
    if len(payload) != 4 * count:
        raise ValueError(f"shard {header.get('shard')}: {len(payload)} bytes of predictions, "
                         f"the header says {header['shape']} float32")
    return header, payload


def predict_shard(model: Any, index: int) -> bytes:
    """Shard ``index``'s output object."""
    import torch

    with torch.no_grad():
        return encode(index, model(shard_inputs(index)))


def run_shards(ckpt: Any, shards: int, *, shard_seconds: float = 0.0,
               crash_after: int | None = None) -> dict[str, Any]:
    """Predict shards ``cursor .. shards - 1`` and commit each output exactly once (see the
    module docstring). ``crash_after``: raise RuntimeError once that shard's output and cursor
    are committed (to show a retry resuming). Returns ``shards``, ``written`` and ``reused``
    (this try), ``resumed_at`` (the cursor restored), ``store`` and ``outputs`` (every
    shard's object name)."""
    from cairn.exceptions import AlreadyExists

    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive integer, got {shards!r}")
    ckpt.restore()  # no model: the snapshot holds only the cursor, in extras
    resumed_at = cursor = int(ckpt.extras.get("cursor", 0))
    print(f"batch inference: {shards} shards, starting at shard {cursor}", file=sys.stderr)
    backend = ckpt.store.backend
    prefix = output_prefix(ckpt.key)
    model = build_model()
    written = reused = 0
    for index in range(cursor, shards):
        data = predict_shard(model, index)
        if shard_seconds:
            time.sleep(shard_seconds)
        try:
            with backend.open_writer(prefix + shard_name(index)) as writer:
                writer.write(data)
                writer.commit()
        except AlreadyExists:
            reused += 1  # an earlier try committed it, then was killed before its cursor snapshot
        else:
            written += 1
        ckpt.extras["cursor"] = index + 1
        ckpt.step(index)
        if crash_after == index:
            raise RuntimeError(f"simulated failure after committing shard {index}")
    return {"shards": shards, "written": written, "reused": reused, "resumed_at": resumed_at,
            "store": ckpt.store.url, "outputs": [prefix + shard_name(i) for i in range(shards)]}


def check_outputs(result: dict[str, Any]) -> dict[str, Any]:
    """Read every output named in ``run_shards``' result back from the store and check it:
    one object per shard, in order, each a well-formed output. Needs no torch."""
    from cairn import open_store

    names = list(result["outputs"])
    if len(names) != result["shards"]:
        raise ValueError(f"{len(names)} outputs for {result['shards']} shards")
    rows = size = 0
    with open_store(result["store"], create=False) as store:
        for index, name in enumerate(names):
            data = store.backend.read(name)
            header, _ = decode(data)
            if header["shard"] != index or not name.endswith("/" + shard_name(index)):
                raise ValueError(f"{name} holds shard {header['shard']}, expected {index}")
            rows += int(header["shape"][0])
            size += len(data)
    return {"shards": len(names), "rows": rows, "bytes": size}
