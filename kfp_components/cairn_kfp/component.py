"""``@cairn_kfp.component``: a KFP v2 Python component whose function gets a cairn Checkpointer.

::

    @cairn_kfp.component(every_steps=100, store="gs://bucket/cairn")
    def train(epochs: int, ckpt) -> float:
        import torch
        ...
        start = ckpt.restore(model=model, optimizer=opt)
        for step in range(start, total):
            ...
            ckpt.step(step)
        return loss

    @dsl.pipeline
    def pipeline():
        train(epochs=3).set_retry(num_retries=3)   # ckpt is not a KFP input

KFP ships only a function's source (decorators stripped) and knows nothing of a Checkpointer,
so the decorator **generates** a new function and turns that into the component. Its
parameters are the function's own (minus the one named ``ckpt`` or annotated
``Checkpointer``) plus:

- ``cairn_store``: the store URL (default: the decorator's ``store=``, else ``$CAIRN_STORE``);
- ``cairn_run_id``, ``cairn_task_name``: filled by the call wrapper with
  ``dsl.PIPELINE_JOB_ID_PLACEHOLDER`` and ``dsl.PIPELINE_TASK_NAME_PLACEHOLDER``, each as a
  whole value (a placeholder inside an f-string reaches a real backend unresolved);
- ``cairn_loop_item``: filled with the loop item when the call is inside a ``dsl.ParallelFor``
  (typed like the item, so there is one component variant per item type);
- ``cairn_key``: a whole key that overrides the rest (nested or fallback tasks that must share
  work); ``cairn_checkpoint_prefix``: replaces the run id, so a later run resumes the work;
- ``cairn_options``: the Checkpointer's options (``every_steps``, ``every_seconds``,
  ``persist``, ``when_busy``, ``buffers``, ``max_failures``, ``keep_snapshots``).

The key is ``(checkpoint_prefix or run id, task name[, loop item])``; never the task id,
which changes on every retry. A value that is still a placeholder (``{{$.`` ...) at run time
is a ConfigError. The generated source reads nothing from module globals: the runtime helpers
(:mod:`cairn_kfp._runtime`) and the function itself are nested in it, with annotations and
defaults removed from the nested copy (the generated signature carries them).
"""

from __future__ import annotations

import ast
import copy
import inspect
import itertools
import linecache
import textwrap
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kfp import dsl
from kfp.dsl import pipeline_context, tasks_group

from cairn.exceptions import ConfigError
from cairn_kfp import _runtime
from cairn_kfp.images import DEFAULT_IMAGE

CKPT_PARAMETER = "ckpt"
RESERVED = ("cairn_store", "cairn_run_id", "cairn_task_name", "cairn_loop_item", "cairn_key",
            "cairn_checkpoint_prefix", "cairn_options")
CHECKPOINTER_OPTIONS = frozenset({"every_steps", "every_seconds", "persist", "when_busy",
                                  "buffers", "max_failures", "keep_snapshots"})

# KFP parameter types a loop item can have, by the name KFP gives the loop argument's type.
_LOOP_ITEM_TYPES = {"str": "str", "string": "str", "int": "int", "integer": "int",
                    "float": "float", "double": "float", "bool": "bool", "boolean": "bool",
                    "dict": "dict", "struct": "dict", "list": "list"}
_serial = itertools.count()


@dataclass(frozen=True)
class Settings:
    """What the decorator was given (defaults of the generated parameters)."""

    base_image: str = DEFAULT_IMAGE
    store: str = ""
    key: str = ""
    checkpoint_prefix: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    kfp_options: Mapping[str, Any] = field(default_factory=dict)


def _strip(fn_node: ast.FunctionDef, *, docstrings: bool = True) -> ast.FunctionDef:
    """A copy of a function definition without decorators, annotations or defaults: the form
    nested in generated source, where none of them could be evaluated. ``docstrings=False``
    also drops every docstring (cairn's own helpers: shorter source, no ``{{$.`` text)."""
    node = copy.deepcopy(fn_node)
    if not docstrings:
        for inner in ast.walk(node):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner.body and \
                    isinstance(inner.body[0], ast.Expr) and \
                    isinstance(inner.body[0].value, ast.Constant) and \
                    isinstance(inner.body[0].value.value, str):
                inner.body = inner.body[1:] or [ast.Pass()]
    node.decorator_list = []
    node.returns = None
    args = node.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    args.defaults = []
    args.kw_defaults = [None] * len(args.kwonlyargs)
    for inner in ast.walk(node):  # nested functions keep their defaults, lose annotations
        if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.Lambda)):
            if not isinstance(inner, ast.Lambda):
                inner.returns = None
            a = inner.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    arg.annotation = None
    return node


def embedded_source(helper: Callable[..., Any]) -> str:
    """One of cairn's runtime helpers as shipped: no docstrings, annotations or decorators."""
    return ast.unparse(_strip(_function_node(helper), docstrings=False))


def _function_node(fn: Callable[..., Any]) -> ast.FunctionDef:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise ConfigError(f"{getattr(fn, '__name__', fn)!r}: its source cannot be read; KFP "
                          "ships a component's source, so define it in a .py file") from None
    tree = ast.parse(source)
    node = tree.body[0] if tree.body else None
    if isinstance(node, ast.AsyncFunctionDef):
        raise ConfigError(f"{fn.__name__}: async functions cannot be KFP components")
    if not isinstance(node, ast.FunctionDef):
        raise ConfigError(f"{fn.__name__}: a cairn component must be a plain `def` function")
    return node


def _names_checkpointer(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)
    return any(part.rsplit(".", 1)[-1].strip(" '\"") == "Checkpointer"
               for part in text.replace("|", ",").replace("[", ",").replace("]", ",").split(","))


def checkpointer_parameter(node: ast.FunctionDef) -> str | None:
    """The parameter that receives the Checkpointer (named ``ckpt`` or annotated
    ``Checkpointer``), or None. ConfigError when two qualify or it is positional-only."""
    args = node.args
    found = [a for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]
             if a.arg == CKPT_PARAMETER or _names_checkpointer(a.annotation)]
    if len(found) > 1:
        raise ConfigError(f"{node.name}: parameters {[a.arg for a in found]} all ask for the "
                          "cairn Checkpointer; keep one")
    if found and found[0] in args.posonlyargs:
        raise ConfigError(f"{node.name}: the Checkpointer parameter {found[0].arg!r} is "
                          "positional-only; cairn passes it by keyword")
    return found[0].arg if found else None


def _signature_source(node: ast.FunctionDef, ckpt: str | None, settings: Settings,
                      loop_type: str) -> tuple[str, list[str]]:
    """The generated ``def`` line's parameter list, and the user's parameter names."""
    args = node.args
    if args.vararg is not None or args.kwarg is not None or args.posonlyargs:
        raise ConfigError(f"{node.name}: KFP components take named parameters only (no *args, "
                          "**kwargs or positional-only parameters)")
    positional, keyword = [], []
    first_default = len(args.args) - len(args.defaults)
    for index, arg in enumerate(args.args):
        default = args.defaults[index - first_default] if index >= first_default else None
        positional.append((arg, default))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        keyword.append((arg, default))
    names = []
    parts = []

    def emit(arg: ast.arg, default: ast.expr | None) -> None:
        if arg.arg in RESERVED:
            raise ConfigError(f"{node.name}: parameter {arg.arg!r} is reserved by cairn_kfp; "
                              "rename it")
        if arg.arg == ckpt:
            return
        if arg.annotation is None:
            raise ConfigError(f"{node.name}: parameter {arg.arg!r} needs a type annotation "
                              "(KFP derives the component's inputs from them)")
        text = f"{arg.arg}: {ast.unparse(arg.annotation)}"
        if default is not None:
            text += f" = {ast.unparse(default)}"
        parts.append(text)
        names.append(arg.arg)

    for arg, default in positional:
        emit(arg, default)
    if keyword:
        parts.append("*")
        for arg, default in keyword:
            emit(arg, default)
    loop_default = {"str": "''", "int": "0", "float": "0.0", "bool": "False", "dict": "{}",
                    "list": "[]"}[loop_type]
    parts += [
        f"cairn_store: str = {settings.store!r}",
        "cairn_run_id: str = ''",
        "cairn_task_name: str = ''",
        f"cairn_loop_item: {loop_type} = {loop_default}",
        f"cairn_key: str = {settings.key!r}",
        f"cairn_checkpoint_prefix: str = {settings.checkpoint_prefix!r}",
        f"cairn_options: dict = {dict(settings.options)!r}",
    ]
    return ", ".join(parts), names


def generate_source(fn: Callable[..., Any], *, settings: Settings,
                    loop_type: str = "str") -> str:
    """The source of the function KFP ships for ``fn`` (see the module docstring)."""
    node = _function_node(fn)
    ckpt = checkpointer_parameter(node)
    params, names = _signature_source(node, ckpt, settings, loop_type)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    helpers = [embedded_source(helper) for helper in _runtime.EMBEDDED]
    inner = ast.unparse(_strip(node))
    call_args = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
    body = "\n\n".join(helpers + [inner]) + (
        f"\n\nreturn _cairn_run({node.name}, {call_args}, {ckpt!r}, store=cairn_store,"
        f" key=_cairn_key(run_id=cairn_run_id, task_name=cairn_task_name,"
        f" loop_item=cairn_loop_item, key=cairn_key,"
        f" checkpoint_prefix=cairn_checkpoint_prefix), options=cairn_options,"
        f" run_id=cairn_run_id)\n")
    doc = ast.get_docstring(node)
    doc_line = f"    {doc!r}\n" if doc else ""
    return (f"def {node.name}({params}){returns}:\n" + doc_line
            + textwrap.indent(body, "    "))


def _define(source: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Execute generated source and return its function, with its source findable by
    ``inspect.getsource`` (KFP reads it from there)."""
    filename = f"<cairn_kfp generated {fn.__name__} #{next(_serial)}>"
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)  # mtime None: kept
    namespace: dict[str, Any] = {}
    namespace.update({name: getattr(typing, name) for name in typing.__all__})
    namespace.update({name: getattr(dsl, name) for name in dsl.__all__})
    namespace["dsl"] = dsl
    namespace.update(getattr(fn, "__globals__", {}))  # the annotations' names, as written
    namespace["__name__"] = "cairn_kfp.generated"
    # dont_inherit: this module's `from __future__ import annotations` must not turn the
    # generated annotations into strings.
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)  # noqa: S102
    generated = namespace[fn.__name__]
    generated.__module__ = "cairn_kfp.generated"
    generated.__qualname__ = fn.__name__
    return generated


def _options(every_steps: int | None, every_seconds: float | None, persist: str | None,
             keep_snapshots: bool,
             checkpointer_options: Mapping[str, Any] | None) -> dict[str, Any]:
    options = dict(checkpointer_options or {})
    unknown = sorted(set(options) - CHECKPOINTER_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown checkpointer_options {unknown}; known: "
                          f"{sorted(CHECKPOINTER_OPTIONS)}")
    if every_steps is not None:
        options["every_steps"] = every_steps
    if every_seconds is not None:
        options["every_seconds"] = every_seconds
    if persist is not None:
        options["persist"] = str(getattr(persist, "value", persist))
    if keep_snapshots:
        options["keep_snapshots"] = True
    for name in ("persist", "when_busy"):
        if name in options:
            options[name] = str(getattr(options[name], "value", options[name]))
    return options


def _loop_type(channel: Any) -> str:
    kind = str(getattr(channel, "channel_type", "") or "String").strip()
    head = kind.split("[", 1)[0].rsplit(".", 1)[-1].lower()
    if head in ("mapping",):
        head = "dict"
    if head in ("sequence",):
        head = "list"
    return _LOOP_ITEM_TYPES.get(head, "str")


def _enclosing_loops() -> list[tasks_group.ParallelFor]:
    pipeline = pipeline_context.Pipeline.get_default_pipeline()
    if pipeline is None:
        return []
    return [g for g in pipeline.groups if isinstance(g, tasks_group.ParallelFor)]


class CairnComponent:
    """A generated KFP component plus the call wrapper that fills the cairn parameters.

    Call it like any KFP component (keyword arguments). ``.component`` is the KFP component
    for the plain case (no loop item), e.g. to compile it to YAML; ``.source`` its source.
    """

    def __init__(self, fn: Callable[..., Any], settings: Settings) -> None:
        self.python_func = fn
        self.settings = settings
        self.name = fn.__name__
        self._variants: dict[str, Any] = {}
        self.component = self.variant("str")  # generated now: bad functions fail at import
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__

    @property
    def source(self) -> str:
        return generate_source(self.python_func, settings=self.settings)

    def variant(self, loop_type: str) -> Any:
        """The component whose ``cairn_loop_item`` is of KFP type ``loop_type``."""
        if loop_type not in self._variants:
            source = generate_source(self.python_func, settings=self.settings,
                                     loop_type=loop_type)
            generated = _define(source, self.python_func)
            options = {"install_kfp_package": False, **self.settings.kfp_options}
            self._variants[loop_type] = dsl.component(
                generated, base_image=self.settings.base_image, **options)
        return self._variants[loop_type]

    def __call__(self, **kwargs: Any) -> Any:
        kwargs.setdefault("cairn_run_id", dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        kwargs.setdefault("cairn_task_name", dsl.PIPELINE_TASK_NAME_PLACEHOLDER)
        loop_type = "str"
        if "cairn_loop_item" in kwargs:
            item = kwargs["cairn_loop_item"]
            loop_type = _loop_type(item) if hasattr(item, "channel_type") else \
                _LOOP_ITEM_TYPES.get(type(item).__name__, "str")
        else:
            loops = _enclosing_loops()
            if len(loops) > 1 and not kwargs.get("cairn_key"):
                raise ConfigError(
                    f"{self.name}: called inside {len(loops)} nested dsl.ParallelFor loops; "
                    "cairn fills cairn_loop_item from one loop only. Pass cairn_loop_item= (an "
                    "item that names the iteration of every loop) or cairn_key=")
            if loops:
                argument = loops[-1].loop_argument
                if not hasattr(argument, "channel_type") or \
                        type(argument).__name__ == "LoopArtifactArgument":
                    raise ConfigError(f"{self.name}: inside a ParallelFor over artifacts; pass "
                                      "cairn_loop_item= or cairn_key=")
                kwargs["cairn_loop_item"] = argument
                loop_type = _loop_type(argument)
        return self.variant(loop_type)(**kwargs)


def component(fn: Callable[..., Any] | None = None, *, base_image: str = DEFAULT_IMAGE,
              store: str = "", key: str = "", checkpoint_prefix: str = "",
              every_steps: int | None = None, every_seconds: float | None = None,
              persist: str | None = None, keep_snapshots: bool = False,
              checkpointer_options: Mapping[str, Any] | None = None,
              **kfp_options: Any) -> Any:
    """Decorate a function into a cairn KFP component (see the module docstring).

    ``base_image`` must carry cairn, torch and kfp (``containers/Dockerfile.runtime``).
    ``store``, ``key`` and ``checkpoint_prefix`` are defaults of the generated parameters; the
    Checkpointer options become the default of ``cairn_options``. Other keywords go to
    ``kfp.dsl.component`` (``install_kfp_package`` defaults to False: the image has kfp).
    """
    for name in ("store", "key", "checkpoint_prefix"):
        value = locals()[name]
        if not isinstance(value, str):
            raise ConfigError(f"{name}= must be text (a pipeline parameter is passed at call "
                              f"time as cairn_{name}=...)")
        if "{{$." in value:
            raise ConfigError(f"{name}={value!r} holds a KFP placeholder; placeholders must be "
                              "whole argument values, passed at call time")
    if "packages_to_install" in kfp_options:
        raise ConfigError("packages_to_install reinstalls at every retry; build the packages "
                          "into base_image instead (containers/Dockerfile.runtime)")
    settings = Settings(base_image=base_image, store=store, key=key,
                        checkpoint_prefix=checkpoint_prefix,
                        options=_options(every_steps, every_seconds, persist, keep_snapshots,
                                         checkpointer_options),
                        kfp_options=kfp_options)
    if fn is not None:
        return CairnComponent(fn, settings)
    return lambda f: CairnComponent(f, settings)
