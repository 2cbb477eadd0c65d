"""Ready components: ``train`` and ``batch_inference`` (state mode, Python components).

Both call a function of yours by its import path (``"package.module:function"``), which must
be importable in the component's image. Their specs are checked in under
``kfp_components/specs/`` (``python -m cairn_kfp.specs`` regenerates them).
"""

from __future__ import annotations

from kfp.dsl import Dataset, Input, Output

from cairn_kfp.component import component


@component(every_seconds=600.0)
def train(entrypoint: str, arguments: dict = {}, ckpt=None) -> dict:  # noqa: B006 - KFP default
    """Train under a cairn Checkpointer: calls ``function(ckpt=ckpt, **arguments)`` for
    ``entrypoint`` = ``"package.module:function"``, which restores, steps and returns a
    JSON-able result (KFP passes the dict's numbers as doubles; integral ones are given back
    as int unless the parameter is annotated ``float``). A retry resumes from the last
    committed snapshot. Returns ``result`` (the function's return value), ``key``, ``step``
    (the last committed step) and ``resumed_step`` (the step restored at the start, or
    None)."""
    import importlib
    import inspect

    module_name, _, name = entrypoint.partition(":")
    if not module_name or not name:
        raise ValueError(f"entrypoint {entrypoint!r} must look like 'package.module:function'")
    function = getattr(importlib.import_module(module_name), name)
    # KFP carries a dict's numbers as doubles: an integral one goes back to int unless the
    # function's parameter is annotated float.
    hints = {p.name: p.annotation for p in inspect.signature(function).parameters.values()}
    arguments = {k: int(v) if isinstance(v, float) and v.is_integer()
                 and hints.get(k) not in (float, "float") else v
                 for k, v in (arguments or {}).items()}
    result = function(ckpt=ckpt, **arguments)
    restored = ckpt.restored_from
    return {"result": result, "key": str(ckpt.key), "step": ckpt.committed_step,
            "resumed_step": restored.step if restored is not None else None}


@component(every_steps=1, persist="inline")
def batch_inference(predictor: str, inputs: Input[Dataset], results: Output[Dataset],
                    ckpt=None) -> dict:
    """Run ``predictor`` (``"package.module:function"``, called as ``function(input_path,
    output_path)``, writing one output file) over every file of the ``inputs`` directory in
    name order. Each output is committed to the store create-only, as
    ``outputs/<key>/<input name>``, exactly once: the cursor (the next input) is in the
    snapshot, and an output that a killed attempt committed after its last snapshot is found
    taken and kept, not written again. Once all are committed, ``results`` receives every
    output (read back from the store, as a retry's local directory starts empty) plus
    ``index.json``. Returns the counts ``inputs``, ``written`` and ``reused`` (this attempt)
    and ``resumed_at`` (the cursor restored)."""
    import importlib
    import json
    import os

    from cairn import Key
    from cairn.exceptions import AlreadyExists

    def encode_component(name: str) -> str:  # as a key component is spelled in a store path
        return Key((name,)).path

    module_name, _, name = predictor.partition(":")
    if not module_name or not name:
        raise ValueError(f"predictor {predictor!r} must look like 'package.module:function'")
    predict = getattr(importlib.import_module(module_name), name)
    if os.path.isdir(inputs.path):
        source_dir = inputs.path
        names = sorted(n for n in os.listdir(source_dir) if not n.startswith("."))
    else:
        source_dir, single = os.path.split(inputs.path)
        names = [single]
    ckpt.restore()
    resumed_at = cursor = int(ckpt.extras.get("cursor", 0))
    backend = ckpt.store.backend
    prefix = "outputs/" + ckpt.key.path + "/"
    os.makedirs(results.path, exist_ok=True)
    written = reused = 0
    for index in range(cursor, len(names)):
        target = os.path.join(results.path, encode_component(names[index]))
        partial = target + ".partial"
        predict(os.path.join(source_dir, names[index]), partial)
        try:
            with open(partial, "rb") as src, backend.open_writer(
                    prefix + encode_component(names[index])) as writer:
                for block in iter(lambda: src.read(1 << 22), b""):
                    writer.write(block)
                writer.commit()
        except AlreadyExists:
            reused += 1  # committed by an attempt killed before its cursor snapshot
            os.remove(partial)
        else:
            written += 1
            os.replace(partial, target)
        ckpt.extras["cursor"] = index + 1
        ckpt.step(index)
    for input_name in names:
        encoded = encode_component(input_name)
        target = os.path.join(results.path, encoded)
        if os.path.exists(target):
            continue
        with open(target + ".partial", "wb") as dst:
            offset = 0
            while True:
                block = backend.read_range(prefix + encoded, offset, 1 << 22)
                if not block:
                    break
                dst.write(block)
                offset += len(block)
        os.replace(target + ".partial", target)
    index_doc = {"store": ckpt.store.url, "key": str(ckpt.key),
                 "outputs": [prefix + encode_component(n) for n in names]}
    with open(os.path.join(results.path, "index.json"), "w") as f:
        json.dump(index_doc, f, indent=1)
    results.metadata["cairn_store"] = ckpt.store.url
    results.metadata["cairn_prefix"] = prefix
    return {"inputs": len(names), "written": written, "reused": reused,
            "resumed_at": resumed_at}
