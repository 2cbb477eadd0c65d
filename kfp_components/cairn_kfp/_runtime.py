"""What a generated component runs inside its container.

KFP ships only a component function's source, so the source of every function here is copied
into each generated component (nested in it): each one imports what it needs itself, uses
nothing from this module's globals, and needs only ``cairn`` (and torch, when a Checkpointer
is asked for) in the image. :mod:`cairn_kfp.component` does the copying; these same functions
are also called directly (and tested) outside KFP.
"""

from __future__ import annotations

from typing import Any


def _cairn_key(*, run_id: Any, task_name: Any, loop_item: Any, key: Any,
               checkpoint_prefix: Any) -> str:
    """The key of this task's work, as ``Key`` text.

    ``key`` (a whole key) wins; else ``(checkpoint_prefix or run_id, task_name[, loop_item])``,
    where ``checkpoint_prefix`` may hold several ``/``-separated components. An empty
    ``loop_item`` (``""`` or None) adds no component; any other value is used as text (JSON,
    with sorted keys, for numbers, lists and dicts). Raises ConfigError for a value that is
    still a KFP placeholder (``{{$.`` ...), which the backend leaves as it is when the
    placeholder was put inside a longer string. (Docstrings are not shipped.)
    """
    import json

    from cairn.exceptions import ConfigError
    from cairn.store import Key

    unresolved = "{" + "{$."  # spelled apart: the shipped source must hold no placeholder

    def resolved(name: str, value: Any) -> Any:
        if isinstance(value, str) and unresolved in value:
            raise ConfigError(
                f"{name} is {value!r}: a KFP placeholder that was never resolved. Pass "
                "dsl.PIPELINE_JOB_ID_PLACEHOLDER and dsl.PIPELINE_TASK_NAME_PLACEHOLDER each as "
                "the whole value of an argument (never inside an f-string or a longer string), "
                "or give cairn_key= a plain key")
        return value

    if key:
        return str(Key.parse(resolved("cairn_key", key)))
    head = resolved("cairn_checkpoint_prefix", checkpoint_prefix) or \
        resolved("cairn_run_id", run_id)
    task = resolved("cairn_task_name", task_name)
    if not head or not task:
        raise ConfigError(
            "no key for this task: cairn_run_id and cairn_task_name are empty. Call the "
            "component inside a pipeline (its wrapper fills them with the job-id and task-name "
            "placeholders), or pass cairn_key=")
    components = list(Key.parse(head).components) + [task]
    item = resolved("cairn_loop_item", loop_item)
    if item is not None and item != "":
        components.append(item if isinstance(item, str)
                          else json.dumps(item, sort_keys=True, separators=(",", ":")))
    return str(Key(tuple(components)))


def _cairn_run(fn: Any, kwargs: dict[str, Any], ckpt_parameter: str | None, *, store: str,
               key: str, options: dict[str, Any]) -> Any:
    """Call ``fn(**kwargs)`` as one attempt of ``key``'s work in ``store``.

    ``CAIRN_STORE`` and ``CAIRN_KEY`` are set for the call (for subprocesses and
    ``Checkpointer.from_env()``). With ``ckpt_parameter``, that parameter receives a
    ``cairn.state.Checkpointer`` built from ``options`` (``every_steps``, ``every_seconds``,
    ``persist``, ``when_busy``, ``buffers``, ``max_failures``; ``keep_snapshots`` keeps the
    snapshots after success). On success the key is marked done (unless ``keep_snapshots``)
    and the Checkpointer closed; on failure it is closed and the error propagates, so KFP's
    retry policy reruns the task, which resumes from the last committed snapshot.
    """
    import json
    import logging
    import os

    from cairn.exceptions import ConfigError

    log = logging.getLogger("cairn_kfp")
    store = store or os.environ.get("CAIRN_STORE", "")
    if not store:
        raise ConfigError("no cairn store: pass cairn_store= (a directory or gs://BUCKET/PREFIX) "
                          "to the component or to the decorator's store=, or set CAIRN_STORE")
    if "{" + "{$." in store:  # spelled apart: the shipped source must hold no placeholder
        raise ConfigError(f"cairn_store is {store!r}, an unresolved KFP placeholder; pass a "
                          "store URL or a pipeline parameter as the whole value")
    allowed = {"every_steps", "every_seconds", "persist", "when_busy", "buffers",
               "max_failures", "keep_snapshots"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"unknown cairn_options {unknown}; known: {sorted(allowed)}")
    options = dict(options)
    keep = bool(options.pop("keep_snapshots", False))
    for name in ("every_steps", "buffers", "max_failures"):  # KFP passes dict numbers as floats
        if isinstance(options.get(name), float) and options[name].is_integer():
            options[name] = int(options[name])
    os.environ["CAIRN_STORE"], os.environ["CAIRN_KEY"] = store, key
    print("cairn: key " + json.dumps(key) + " in " + json.dumps(store), flush=True)
    if ckpt_parameter is None:
        return fn(**kwargs)

    from cairn.state.checkpointer import Checkpointer, PersistMode, WhenBusy

    if "persist" in options:
        options["persist"] = PersistMode(options["persist"])
    if "when_busy" in options:
        options["when_busy"] = WhenBusy(options["when_busy"])
    ckpt = Checkpointer(store=store, key=key, **options)
    try:
        result = fn(**kwargs, **{ckpt_parameter: ckpt})
    except BaseException as error:
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - the function's error is the one to raise
            log.error("cairn: closing the Checkpointer after %s failed: %s",
                      type(error).__name__, e)
        raise
    try:
        if not keep and getattr(ckpt, "_attempt", None) is not None:
            ckpt.finish()
    finally:
        ckpt.close()  # raises if the last snapshot was not committed
    restored = ckpt.restored_from
    print("cairn: " + json.dumps({
        "key": key, "store": store, "seq": ckpt.committed_seq, "step": ckpt.committed_step,
        "resumed_from": restored.seq if restored is not None else None, "done": not keep,
    }), flush=True)
    return result


#: The functions copied into every generated component, in order.
EMBEDDED = (_cairn_key, _cairn_run)
