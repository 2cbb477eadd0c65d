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
    from cairn import Key

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
    retry policy reruns the task, which resumes from the last committed snapshot. A restore
    that failed on this side (:class:`cairn.exceptions.RestoreFailed`: a library error, a bug,
    out of memory; no snapshot was skipped) ends the container with exit 8, as ``cairn run``.

    Every try that opened an attempt (``ckpt.restore``) files its outcome record
    (``succeeded``, ``preempted``, ``fenced`` or ``failed``; best effort, as outcomes are
    advice), with the capacity option and reason of ``$CAIRN_PLACEMENT_OPTION`` and
    ``$CAIRN_PLACEMENT_REASON`` when set; a try without a record was killed from outside.

    The resume policy (``resume_on``, ``max_error_retries``, ``loop_guard`` in ``options``;
    :mod:`cairn.policy.resume`) plans each try through :class:`cairn.tries.Try`: snapshots it
    rules out are never restored, and a step that failed with its own error more than
    ``max_error_retries`` times raises :class:`cairn.exceptions.GaveUp` before ``fn`` runs.

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
    from cairn.runtime import env

    log = logging.getLogger("cairn_kfp")
    store = store or env.STORE.get() or ""
    if not store:
        raise ConfigError("no cairn store: pass cairn_store= (a directory or gs://BUCKET/PREFIX) "
                          f"to the component or to the decorator's store=, or set {env.STORE}")
    if "{" + "{$." in store:  # spelled apart: the shipped source must hold no placeholder
        raise ConfigError(f"cairn_store is {store!r}, an unresolved KFP placeholder; pass a "
                          "store URL or a pipeline parameter as the whole value")
    policy_names = ("resume_on", "max_error_retries", "loop_guard")
    allowed = {"every_steps", "every_seconds", "persist", "when_busy", "buffers",
               "max_failures", "keep_snapshots", "share_result", *policy_names}
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
    for name in ("every_steps", "buffers", "max_failures", "max_error_retries"):
        if isinstance(options.get(name), float) and options[name].is_integer():
            options[name] = int(options[name])  # KFP passes dict numbers as floats
    from cairn import ResumePolicy, Try
    from cairn.runtime.rollback import unkept_note

    policy = ResumePolicy(**{n: options.pop(n) for n in policy_names if n in options})
    this_try = Try.begin(store=store, key=key, policy=policy)
    if this_try.unnumbered_note() is not None:
        print(this_try.unnumbered_note(), flush=True)
    print(unkept_note(orchestrator="Kubeflow Pipelines"), flush=True)
    print("cairn: resume plan: " + this_try.reason, flush=True)
    os.environ.update(this_try.env())
    print("cairn: key " + json.dumps(key) + " in " + json.dumps(store), flush=True)
    result_name = _cairn_result_name(key, run_id) if share else None
    if result_name is not None:
        from cairn.exceptions import NotFound
        from cairn import open_store

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
    this_try.check()  # a crash loop: fail before the function runs again

    def exit_if_restore_failed(error: BaseException) -> None:
        from cairn.exceptions import RestoreFailed
        from cairn.runtime.exits import ExitCode

        if isinstance(error, RestoreFailed):  # exit 8, as cairn run: not the step's own error
            log.error("cairn: %s (exit %d)", error, ExitCode.RESTORE_FAILED)
            raise SystemExit(int(ExitCode.RESTORE_FAILED)) from error

    if ckpt_parameter is None:
        try:
            result = fn(**kwargs)
        except Exception as error:
            exit_if_restore_failed(error)
            raise
        if result_name is not None:
            from cairn import open_store

            with open_store(store) as opened:
                _cairn_keep_result(opened, result_name, result)
        return result

    from cairn import PersistMode, WhenBusy

    if "persist" in options:
        options["persist"] = PersistMode(options["persist"])
    if "when_busy" in options:
        options["when_busy"] = WhenBusy(options["when_busy"])
    ckpt = this_try.checkpointer(**options)
    detail = {"orchestrator": "kfp"}
    try:
        result = fn(**kwargs, **{ckpt_parameter: ckpt})
        if result_name is not None:
            _cairn_keep_result(ckpt.store, result_name, result)  # before done: see docstring
        if not keep and ckpt.epoch is not None:
            ckpt.finish()
    except BaseException as error:
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - the function's error is the one to raise
            log.error("cairn: closing the Checkpointer after %s failed: %s",
                      type(error).__name__, e)
        this_try.ended(error=error, ckpt=ckpt, detail=detail)
        exit_if_restore_failed(error)
        raise
    try:
        ckpt.close()  # raises if the last snapshot was not committed
    except BaseException as error:
        this_try.ended(error=error, ckpt=ckpt, detail=detail)
        raise
    this_try.ended(error=None, ckpt=ckpt, detail=detail)
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
    from cairn import Key

    return ("outputs/" + Key.parse(key).path + "/@kfp-result/" + Key((run_id,)).path
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


#: The functions copied into every generated component, in order.
EMBEDDED = (_cairn_key, _cairn_run, _cairn_result_name, _cairn_keep_result)
