"""``@task.cairn(pod={...})``: the decorated function runs in a Kubernetes pod, in state mode.

::

    @task.cairn(pod={"image": "REPO/train:1.0", "sidecar_image": "REPO/cairn-sidecar:0.1.0",
                     "namespace": "training", "container_resources": ...},
                every_steps=50, retries=3)
    def train(epochs: int, ckpt):
        ...
        start = ckpt.restore(model=model, optimizer=opt)
        for step in range(start, total):
            ...
            ckpt.step(step)
        return {"loss": loss}

Contract of one try:

- ``pod=`` holds :class:`~cairn_airflow.kubernetes.CairnKubernetesPodOperator` (and so
  KubernetesPodOperator) arguments; an image is required (it needs ``python`` with cairn, torch
  and the function's own dependencies). ``cmds``/``arguments`` (generated), ``mode`` (always
  ``state``) and ``every`` (``cairn run``'s interval) are refused, and so are operator arguments
  such as ``retries``, which go to ``@task.cairn`` itself;
- the pod is the CairnKubernetesPodOperator's: cairn's transform in state mode (the cairn
  sidecar, the shared volume, ``CAIRN_STORE``/``CAIRN_KEY``/``CAIRN_NOTICE_FILE`` for the key
  ``(dag_id, task_id, run_id, map_index)``), placement, image pinning, strict validation;
- its main container runs what ``@task.kubernetes`` runs (the generated script and the pickled
  arguments are passed base64 in the environment and written to ``/tmp``), with ``exec`` so
  that Python, not bash, is the container's process and gets the kubelet's SIGTERM;
- the script is the function's source (the ``@task.cairn`` decorator removed) followed by a
  cairn wrapper (:func:`_cairn_pod_task`, copied in by source) that rebinds the function's name:
  the ``ckpt`` parameter receives ``Checkpointer.from_env(**options)`` (``every_steps``,
  ``every_seconds`` and ``checkpointer_options`` given to the decorator); after the call the
  key is marked done unless ``keep_snapshots``, the Checkpointer is closed (on failure too),
  and the try's outcome is recorded, as :class:`~cairn_airflow.operators.CairnPythonOperator`
  does. In the pod only cairn is imported, never Airflow or this provider;
- the return value is written to ``/airflow/xcom/return.json`` and pushed to XCom by
  KubernetesPodOperator's XCom sidecar, as for ``@task.kubernetes``; unlike there,
  ``do_xcom_push`` defaults to True, as for every TaskFlow task (``do_xcom_push=False``: no
  XCom sidecar, the value is dropped);
- :class:`cairn.exceptions.Preempted`, :class:`cairn.exceptions.Fenced` and a restore that
  failed on the pod's side (:class:`cairn.exceptions.RestoreFailed`) end the script with the
  exit code ``cairn run`` uses for each (:mod:`cairn.runtime.exits`), so the operator raises
  ``Preempted``/``Fenced``/``AirflowFailException`` for them like in process mode.

Why this class shape: ``_CairnKubernetesDecoratedOperator`` subclasses the cncf provider's
``_KubernetesDecoratedOperator`` (first) and ``CairnKubernetesPodOperator``. The method
resolution order is ``_KubernetesDecoratedOperator, DecoratedOperator,
CairnKubernetesPodOperator, KubernetesPodOperator``: the cncf class writes the script, the
arguments file and the command in ``execute`` and then calls on, through
``DecoratedOperator.execute``, into the cairn operator's ``execute`` and
``build_pod_request_obj``, which add cairn's transform and validation to the pod. Only
``get_python_source`` (the script body) and ``_generate_cmds`` (``exec``) are overridden, so the
XCom handling, argument pickling and pod naming stay the cncf provider's. It relies on
``_KubernetesDecoratedOperator`` (a private class) calling ``self.get_python_source()`` and
``self._generate_cmds()``; the cncf version is pinned in the provider's constraints.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from airflow.providers.cncf.kubernetes.decorators.kubernetes import _KubernetesDecoratedOperator
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

from cairn.exceptions import ConfigError
from cairn_airflow.kubernetes import CairnKubernetesPodOperator
from cairn_airflow.operators import checkpointer_options_with, checkpointer_parameter

POD_EXAMPLE = ('pod={"image": "REPO/IMAGE:TAG", "sidecar_image": "REPO/cairn-sidecar:TAG", '
               '"namespace": "NAMESPACE"}')
# Pod options the decorator sets itself, and why.
RESERVED = {
    "cmds": "the decorator generates the pod's command (it runs the function)",
    "arguments": "the decorator generates the pod's command (it runs the function)",
    "mode": "@task.cairn(pod=...) runs in state mode (the function's ckpt parameter); for "
            "process mode (`cairn run`, CRIU) use CairnKubernetesPodOperator with cmds",
    "every": "in state mode the Checkpointer snapshots as every_steps/every_seconds say: pass "
             "those to @task.cairn",
    "python_callable": "it is the decorated function",
    "op_args": "they are the task's call arguments",
    "op_kwargs": "they are the task's call arguments",
}
# Options that, when given, may supply the container image instead of ``image``.
IMAGE_SOURCES = ("image", "full_pod_spec", "pod_template_file", "pod_template_dict")


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def pod_option_names() -> frozenset[str]:
    """The keys ``pod=`` accepts: CairnKubernetesPodOperator's and KubernetesPodOperator's
    arguments and ``@task.kubernetes``'s own (``use_dill``), less :data:`RESERVED`."""
    names = {p.name for cls in (CairnKubernetesPodOperator, KubernetesPodOperator,
                                _KubernetesDecoratedOperator)
             for p in _parameters(cls.__init__)}
    return frozenset(names - set(RESERVED))


def pod_operator_kwargs(pod: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The operator keyword arguments for ``@task.cairn(pod=pod, **kwargs)``: ``pod`` checked
    and merged into ``kwargs``. Raises ConfigError naming what to pass."""
    if pod is True or not isinstance(pod, Mapping):
        raise ConfigError(f"pod={pod!r}: give the pod's options as a mapping of "
                          f"CairnKubernetesPodOperator arguments, with at least the image: "
                          f"@task.cairn({POD_EXAMPLE}); the image runs the function, so it needs "
                          "python with cairn, torch and the function's dependencies")
    bad = sorted(str(k) for k in pod if not isinstance(k, str))
    if bad:
        raise ConfigError(f"pod= keys must be argument names (strings), not {bad}")
    for name in pod:
        if name in RESERVED:
            raise ConfigError(f"pod= must not set {name!r}: {RESERVED[name]}")
    allowed = pod_option_names()
    unknown = sorted(set(pod) - allowed)
    if unknown:
        from airflow.sdk import BaseOperator

        base = {p.name for p in _parameters(BaseOperator.__init__)}
        task_level = [n for n in unknown if n in base]
        if task_level:
            raise ConfigError(f"pod= must not set {task_level}: these are task arguments; pass "
                              f"them to @task.cairn itself, next to pod=")
        hints = {n: difflib.get_close_matches(n, sorted(allowed), n=1) for n in unknown}
        said = ", ".join(f"{n!r} (did you mean {h[0]!r}?)" if h else repr(n)
                         for n, h in hints.items())
        raise ConfigError(f"unknown pod= option(s) {said}: pod= takes CairnKubernetesPodOperator "
                          "and KubernetesPodOperator arguments (image, namespace, sidecar_image, "
                          "container_resources, node_selector, store_url, placement, ...)")
    if not any(pod.get(k) for k in IMAGE_SOURCES):
        raise ConfigError(f"pod= needs an image (or a pod template that names one): "
                          f"@task.cairn({POD_EXAMPLE})")
    required = [p.name for p in _parameters(CairnKubernetesPodOperator.__init__)
                if p.default is inspect.Parameter.empty and p.name not in pod
                and p.name not in kwargs]
    if required:
        raise ConfigError(f"pod= needs {required}: @task.cairn({POD_EXAMPLE})")
    clash = sorted(set(pod) & set(kwargs))
    if clash:
        raise ConfigError(f"{clash} given both in pod= and to @task.cairn: give each once")
    return {**kwargs, **pod}


# -- the script's source -------------------------------------------------------------------------

def _is_cairn_decorator(text: str) -> bool:
    name = text.split("(", 1)[0].strip().replace(" ", "")
    return (name in ("setup", "teardown") or name.rsplit(".", 1)[-1] == "cairn_task"
            or name == "task.cairn" or name.endswith(".task.cairn"))


def function_source(fn: Callable[..., Any]) -> str:
    """``fn``'s source, dedented, without ``@task.cairn``/``@cairn_task`` (or ``@setup``,
    ``@teardown``); other decorators are kept."""
    source = textwrap.dedent(inspect.getsource(fn))  # getsource unwraps hide_checkpointer
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ConfigError(f"the source of {fn.__name__} cannot be parsed on its own ({e}); define "
                          "the task at module level") from None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        raise ConfigError(f"{getattr(fn, '__name__', fn)!r}: @task.cairn(pod=...) runs a plain "
                          "`def` function (not async, not a lambda)")
    kept = [seg for seg in (ast.get_source_segment(source, d) or "" for d in node.decorator_list)
            if not _is_cairn_decorator(seg)]
    lines = source.splitlines(keepends=True)
    return "".join(f"@{seg}\n" for seg in kept) + "".join(lines[node.lineno - 1:])


def _cairn_pod_task(fn: Callable[..., Any], *, ckpt_parameter: str | None, keep_snapshots: bool,
                    options: dict[str, Any]) -> Callable[..., Any]:
    """Runs in the pod (copied into the script by source: self-contained, imports cairn only):
    ``fn`` wrapped so that its Checkpointer parameter receives ``Checkpointer.from_env()``; on
    success the key is marked done (unless ``keep_snapshots``); the Checkpointer is always
    closed; the outcome is recorded (:mod:`cairn.runtime.endings`, as the worker-side operator
    does); Preempted/Fenced/Suspended/RestoreFailed end the process with ``cairn run``'s exit
    codes (:func:`cairn.runtime.session.try_exit_code`)."""
    import functools

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        import sys
        import time
        import traceback

        from cairn.runtime import endings, env, session

        started_at = time.time()
        url, key = env.STORE.get(), env.KEY.get()
        ckpt = None
        if ckpt_parameter is not None:
            from cairn import Checkpointer

            ckpt = Checkpointer.from_env(**options)
            kwargs = {**kwargs, ckpt_parameter: ckpt}
        parsed_key = None
        if url and key:
            from cairn import Key

            parsed_key = Key.parse(key)
        try:
            result = fn(*args, **kwargs)
            if not keep_snapshots and parsed_key is not None:
                endings.mark_done(ckpt, url, parsed_key)
        except BaseException as error:
            if ckpt is not None:
                try:
                    ckpt.close()
                except Exception as e:  # noqa: BLE001 - the call's error is the one to raise
                    print(f"cairn: closing the Checkpointer after {type(error).__name__} "
                          f"failed: {e}", file=sys.stderr)
            if parsed_key is not None:
                endings.record_try(ckpt, url, parsed_key, started_at=started_at, error=error,
                                   detail={"where": "pod"})
            code = session.try_exit_code(error)
            if code is None:
                raise
            traceback.print_exc()
            raise SystemExit(code) from error
        if ckpt is not None:
            ckpt.close()  # raises if the last snapshot was not committed
        if parsed_key is not None:
            endings.record_try(ckpt, url, parsed_key, started_at=started_at, error=None,
                               detail={"where": "pod"})
        return result

    return call


def _options_json(options: Mapping[str, Any]) -> str:
    """The Checkpointer options as JSON for the pod's script: plain values, enums by value
    (the Checkpointer accepts ``persist="process"``, ``when_busy="skip"``)."""
    import enum
    import json

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        raise TypeError(f"{type(value).__name__} is not plain JSON data")

    try:
        return json.dumps(dict(options), default=plain, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpointer_options must be plain values (numbers, text, enums) to "
                          f"reach the pod's script: {e}. Objects such as a PreemptionPolicy "
                          "cannot; set them in the function instead") from None


class _CairnKubernetesDecoratedOperator(_KubernetesDecoratedOperator, CairnKubernetesPodOperator):
    """The operator behind ``@task.cairn(pod={...})`` (see the module docstring).

    :param every_steps: snapshot every this many steps.
    :param every_seconds: snapshot at most this many seconds apart.
    :param keep_snapshots: on success, keep the snapshots instead of marking the key done.
    :param checkpointer_options: more keyword arguments for ``Checkpointer.from_env`` in the pod
        (written into the script as JSON: plain values and enums).
    """

    custom_operator_name: str = "@task.cairn"
    template_fields: Sequence[str] = (*_KubernetesDecoratedOperator.template_fields, "every")

    def __init__(self, *, python_callable: Callable[..., Any], op_args: Any = None,
                 op_kwargs: Any = None, every_steps: int | None = None,
                 every_seconds: float | None = None, keep_snapshots: bool = False,
                 checkpointer_options: Mapping[str, Any] | None = None, mode: str = "state",
                 **kwargs: Any) -> None:
        if mode != "state":
            raise ConfigError(f"mode={mode!r}: {RESERVED['mode']}")
        options = checkpointer_options_with(every_steps=every_steps, every_seconds=every_seconds,
                                            options=checkpointer_options)
        self._cairn_options_json = _options_json(options)
        self.ckpt_parameter = checkpointer_parameter(python_callable)
        if self.ckpt_parameter is not None and self.ckpt_parameter in (op_kwargs or {}):
            raise ConfigError(f"op_kwargs must not set {self.ckpt_parameter!r}: cairn passes the "
                              "Checkpointer there")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep_snapshots = keep_snapshots
        self.checkpointer_options = dict(checkpointer_options or {})
        kwargs.setdefault("do_xcom_push", True)  # a TaskFlow task returns its value
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                         mode="state", **kwargs)

    def get_python_source(self) -> str:
        """The script body: the function's source, then the cairn wrapper rebinding its name
        (the cncf script template calls the function by name)."""
        name = self.python_callable.__name__
        return "\n".join([
            function_source(self.python_callable),
            "",
            textwrap.dedent(inspect.getsource(_cairn_pod_task)),
            "",
            f"{name} = {_cairn_pod_task.__name__}(",
            f"    {name}, ckpt_parameter={self.ckpt_parameter!r},",
            f"    keep_snapshots={bool(self.keep_snapshots)!r},",
            f"    options=__import__('json').loads({self._cairn_options_json!r}))",
            "",
        ])

    def _generate_cmds(self) -> list[str]:
        """``@task.kubernetes``'s command, with ``exec`` before the last ``python`` so that the
        script, not bash (PID 1 ignores SIGTERM), receives the kubelet's SIGTERM."""
        cmds = list(super()._generate_cmds())
        head, sep, last = cmds[-1].rpartition(" && ")
        if sep and last.startswith("python "):
            cmds[-1] = f"{head}{sep}exec {last}"
        return cmds
