"""The decorator: what source it generates, what KFP sees, and what it refuses."""

# No `from __future__ import annotations` here: the plain kfp components below need real ones.
import ast
import textwrap
from pathlib import Path

import pytest
import yaml
from kfp import compiler, dsl

import cairn_kfp
from cairn.exceptions import ConfigError
from cairn_kfp.component import RESERVED

@cairn_kfp.component(every_steps=50, store="/data/cairn", base_image="registry/cairn:1")
def fit(epochs: int, lr: float = 0.1, *, tags: list = [], ckpt=None) -> float:  # noqa: B006
    """Fits."""
    import math

    def helper(x: "torch.Tensor", scale: int = 2) -> float:  # noqa: F821
        return math.sqrt(x * scale)

    return helper(epochs) + lr + len(tags)


def inputs_of(component) -> dict:
    return component.component_spec.inputs


def test_ckpt_is_hidden_and_the_cairn_parameters_are_added() -> None:
    inputs = inputs_of(fit.component)
    assert "ckpt" not in inputs
    assert set(RESERVED) <= set(inputs)
    assert inputs["epochs"].type == "Integer" and not inputs["epochs"].optional
    assert inputs["lr"].default == 0.1
    assert inputs["cairn_store"].default == "/data/cairn"
    assert inputs["cairn_options"].default == {"every_steps": 50}
    assert fit.component.component_spec.implementation.container.image == "registry/cairn:1"


def test_generated_source_runs_alone_with_only_what_kfp_ships(tmp_path: Path) -> None:
    """The shipped module is kfp's imports plus this source: no module globals, no cairn_kfp,
    and the nested copy of the function has no annotations or defaults to evaluate."""
    command = fit.component.component_spec.implementation.container.command
    assert not any("pip install" in part for part in command)  # the image has everything
    shipped = command[-1]
    assert "import cairn_kfp" not in shipped and "from cairn_kfp" not in shipped
    namespace: dict = {}
    exec(compile(shipped, "<shipped>", "exec", dont_inherit=True), namespace)  # noqa: S102
    tree = ast.parse(textwrap.dedent(fit.source))
    [outer] = tree.body
    inner = next(n for n in outer.body if isinstance(n, ast.FunctionDef) and n.name == "fit")
    assert inner.decorator_list == [] and inner.returns is None
    assert all(a.annotation is None for a in inner.args.args + inner.args.kwonlyargs)
    assert namespace["fit"](epochs=8, lr=0.5, tags=["a"], cairn_key="k",
                            cairn_store=str(tmp_path)) == 5.5


def test_the_shipped_function_computes_the_key_and_calls_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    @cairn_kfp.component
    def echo(word: str) -> str:
        import os

        return word + "@" + os.environ["CAIRN_KEY"]

    namespace: dict = {}
    shipped = echo.component.component_spec.implementation.container.command[-1]
    exec(compile(shipped, "<shipped>", "exec", dont_inherit=True), namespace)  # noqa: S102
    monkeypatch.setenv("CAIRN_STORE", str(tmp_path))
    out = namespace["echo"](word="hi", cairn_run_id="job-9", cairn_task_name="echo",
                            cairn_loop_item="x")
    assert out == "hi@job-9/echo/x"
    with pytest.raises(ConfigError, match="never resolved"):
        namespace["echo"](word="hi", cairn_run_id="{{$.pipeline_job_uuid}}-1",
                          cairn_task_name="echo")


def compiled(pipeline, tmp_path: Path) -> dict:
    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    return yaml.safe_load(path.read_text())


def test_the_call_wrapper_passes_whole_placeholders(tmp_path: Path) -> None:
    @dsl.pipeline
    def p() -> float:
        return fit(epochs=2).output

    spec = compiled(p, tmp_path)
    params = spec["root"]["dag"]["tasks"]["fit"]["inputs"]["parameters"]
    assert params["cairn_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert params["cairn_task_name"]["runtimeValue"]["constant"] == "{{$.pipeline_task_name}}"
    assert "cairn_loop_item" not in params


@pytest.mark.parametrize("items, kfp_type", [
    ([1, 2], "NUMBER_INTEGER"), (["a", "b"], "STRING"), ([{"a": 1}, {"a": 2}], "STRUCT"),
])
def test_inside_parallel_for_the_loop_item_is_passed_with_its_type(
        items: list, kfp_type: str, tmp_path: Path) -> None:
    @dsl.pipeline
    def p() -> None:
        with dsl.ParallelFor(items):
            fit(epochs=2)

    spec = compiled(p, tmp_path)
    [loop] = spec["root"]["dag"]["tasks"].values()
    task = spec["components"][loop["componentRef"]["name"]]["dag"]["tasks"]["fit"]
    assert "componentInputParameter" in task["inputs"]["parameters"]["cairn_loop_item"]
    component = spec["components"][task["componentRef"]["name"]]
    assert component["inputDefinitions"]["parameters"]["cairn_loop_item"]["parameterType"] \
        == kfp_type


def test_nested_loops_need_an_explicit_item_or_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nested dsl.ParallelFor"):
        @dsl.pipeline
        def p() -> None:
            with dsl.ParallelFor([1, 2]):
                with dsl.ParallelFor(["a", "b"]):
                    fit(epochs=2)


def test_bad_functions_and_options_are_refused_at_decoration() -> None:
    with pytest.raises(ConfigError, match="reserved"):
        @cairn_kfp.component
        def a(cairn_store: str, ckpt) -> None: ...
    with pytest.raises(ConfigError, match="type annotation"):
        @cairn_kfp.component
        def b(x, ckpt) -> None: ...
    with pytest.raises(ConfigError, match="all ask for"):
        @cairn_kfp.component
        def c(ckpt, other: "Checkpointer") -> None: ...  # noqa: F821
    with pytest.raises(ConfigError, match="placeholder"):
        cairn_kfp.component(key="{{$.pipeline_job_uuid}}/x")
    with pytest.raises(ConfigError, match="packages_to_install"):
        cairn_kfp.component(packages_to_install=["torch"])
    with pytest.raises(ConfigError, match="unknown checkpointer_options"):
        cairn_kfp.component(checkpointer_options={"every": 3})
