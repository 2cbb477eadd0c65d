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
               key: str, options: dict[str, Any], run_id: str = "") -> Any:
    """Call ``fn(**kwargs)`` as one attempt of ``key``'s work in ``store``.

    ``CAIRN_STORE`` and ``CAIRN_KEY`` are set for the call (for subprocesses and
    ``Checkpointer.from_env()``). With ``ckpt_parameter``, that parameter receives a
    ``cairn.state.Checkpointer`` built from ``options`` (``every_steps``, ``every_seconds``,
    ``persist``, ``when_busy``, ``buffers``, ``max_failures``; ``keep_snapshots`` keeps the
    snapshots after success). On success the key is marked done (unless ``keep_snapshots``)
    and the Checkpointer closed; on failure it is closed and the error propagates, so KFP's
    retry policy reruns the task, which resumes from the last committed snapshot.

    Every try that opened an attempt (``ckpt.restore``) files its outcome record
    (``succeeded``, ``preempted``, ``fenced`` or ``failed``; best effort, as outcomes are
    advice), with the capacity option and reason of ``$CAIRN_PLACEMENT_OPTION`` and
    ``$CAIRN_PLACEMENT_REASON`` when set; a try without a record was killed from outside.

    ``share_result`` (needs ``run_id``; the spot → on-demand pattern of
    :mod:`cairn_kfp.fallback`): a success stores the JSON return value as this run's result of
    ``key`` (:func:`_cairn_result_name`) before the key is marked done, and any task of the
    same run and key that finds it returns it without calling ``fn`` — the on-demand fallback
    after a spot task that finished, or a retry after a failure past the return.
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
               "max_failures", "keep_snapshots", "share_result"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"unknown cairn_options {unknown}; known: {sorted(allowed)}")
    options = dict(options)
    keep = bool(options.pop("keep_snapshots", False))
    share = bool(options.pop("share_result", False))
    if share and (not run_id or "{" + "{$." in run_id):
        raise ConfigError("cairn_options['share_result'] needs the run id: call the component "
                          "inside a pipeline (its wrapper passes dsl.PIPELINE_JOB_ID_PLACEHOLDER "
                          f"as cairn_run_id), got {run_id!r}")
    for name in ("every_steps", "buffers", "max_failures"):  # KFP passes dict numbers as floats
        if isinstance(options.get(name), float) and options[name].is_integer():
            options[name] = int(options[name])
    os.environ["CAIRN_STORE"], os.environ["CAIRN_KEY"] = store, key
    print("cairn: key " + json.dumps(key) + " in " + json.dumps(store), flush=True)
    result_name = _cairn_result_name(key, run_id) if share else None
    if result_name is not None:
        from cairn.exceptions import NotFound
        from cairn.store import open_store

        with open_store(store) as opened:
            try:
                doc = json.loads(opened.backend.read(result_name))
            except NotFound:
                doc = None
        if doc is not None:
            # This run's work on the key is finished (by the spot task, or an earlier try):
            # hand back its result; running again would start over on a done key.
            print("cairn: " + json.dumps({"key": key, "run": run_id, "reused_result": True}),
                  flush=True)
            return tuple(doc["value"]) if doc.get("tuple") else doc["value"]
    if ckpt_parameter is None:
        result = fn(**kwargs)
        if result_name is not None:
            from cairn.store import open_store

            with open_store(store) as opened:
                _cairn_keep_result(opened, result_name, result)
        return result

    import time

    from cairn.state.checkpointer import Checkpointer, PersistMode, WhenBusy

    if "persist" in options:
        options["persist"] = PersistMode(options["persist"])
    if "when_busy" in options:
        options["when_busy"] = WhenBusy(options["when_busy"])
    ckpt = Checkpointer(store=store, key=key, **options)
    started = time.time()
    try:
        result = fn(**kwargs, **{ckpt_parameter: ckpt})
        if result_name is not None:
            _cairn_keep_result(ckpt.store, result_name, result)  # before done: see docstring
        if not keep and getattr(ckpt, "_attempt", None) is not None:
            ckpt.finish()
    except BaseException as error:
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - the function's error is the one to raise
            log.error("cairn: closing the Checkpointer after %s failed: %s",
                      type(error).__name__, e)
        _cairn_outcome(ckpt, store, started, error)
        raise
    try:
        ckpt.close()  # raises if the last snapshot was not committed
    except BaseException as error:
        _cairn_outcome(ckpt, store, started, error)
        raise
    _cairn_outcome(ckpt, store, started, None)
    restored = ckpt.restored_from
    print("cairn: " + json.dumps({
        "key": key, "store": store, "seq": ckpt.committed_seq, "step": ckpt.committed_step,
        "resumed_from": restored.seq if restored is not None else None, "done": not keep,
    }), flush=True)
    return result


def _cairn_result_name(key: str, run_id: str) -> str:
    """Where run ``run_id``'s result of ``key`` is kept: ``outputs/<key path>/@kfp-result/
    <run id>.json`` (``@`` is always escaped in key components and in batch_inference's output
    names, so nothing else lands there)."""
    from cairn.store import Key
    from cairn.store.keys import encode_component

    return ("outputs/" + Key.parse(key).path + "/@kfp-result/" + encode_component(run_id)
            + ".json")


def _cairn_keep_result(store: Any, name: str, result: Any) -> None:
    """Store a return value as JSON, create-only (one already there is kept: the same work's
    result). ConfigError when it is not JSON data (KFP parameter outputs always are)."""
    import json

    from cairn.exceptions import AlreadyExists, ConfigError

    is_tuple = isinstance(result, tuple)  # a NamedTuple of outputs: KFP takes it by position
    try:
        data = json.dumps({"schema": "cairn.kfp-result/1", "tuple": is_tuple,
                           "value": list(result) if is_tuple else result}).encode()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"share_result: the return value is not JSON data ({e}); return "
                          "parameters (str, int, float, bool, dict, list) only") from None
    try:
        store.backend.create(name, data)
    except AlreadyExists:
        pass


def _cairn_outcome(ckpt: Any, store: str, started: float, error: Any) -> None:
    """File this try's outcome record: succeeded (``error`` None), preempted, fenced or failed,
    with the placement of ``$CAIRN_PLACEMENT_OPTION``/``$CAIRN_PLACEMENT_REASON``. Nothing
    when the function opened no attempt. Best effort: a failure is logged, never raised (an
    outcome is advice for the next try). Called after the Checkpointer closed its store."""
    import logging
    import time

    log = logging.getLogger("cairn_kfp")
    epoch = getattr(ckpt, "epoch", None)
    if epoch is None:
        return  # no attempt: there is no try to describe
    try:
        from cairn.exceptions import Fenced, Preempted
        from cairn.store import open_store
        from cairn.store.outcomes import Outcome, OutcomeKind, Progress, record_best_effort

        kind = (OutcomeKind.SUCCEEDED if error is None else OutcomeKind.PREEMPTED
                if isinstance(error, Preempted) else OutcomeKind.FENCED
                if isinstance(error, Fenced) else OutcomeKind.FAILED)
        restored = ckpt.restored_from
        detail = {"mode": "state", "orchestrator": "kfp"}
        if error is not None:
            detail["error"] = (type(error).__name__ + ": " + str(error))[:500]
        outcome = Outcome(
            epoch=epoch, outcome=kind, started_at=started, ended_at=max(time.time(), started),
            progress=Progress(start_step=restored.step + 1 if restored is not None
                              and restored.step is not None else 0,
                              kept_step=ckpt.committed_step, snapshot_seq=ckpt.committed_seq),
            snapshot_cost_s=ckpt.snapshot_cost_s, detail=detail)
        with open_store(store, create=False) as opened:
            record_best_effort(opened, ckpt.key, outcome)
    except Exception as e:  # noqa: BLE001 - see docstring
        log.warning("cairn: could not record this try's outcome for key %s: %s", ckpt.key, e)


#: The functions copied into every generated component, in order.
EMBEDDED = (_cairn_key, _cairn_run, _cairn_result_name, _cairn_keep_result, _cairn_outcome)
