"""Checked-in specs: the ready components' YAML (``specs/``) and the compiled example
pipelines (``examples/compiled/``) must equal what the code generates now.

Regenerate after a deliberate change, then review the diff::

    CAIRN_UPDATE_GOLDENS=1 .venv-kfp/bin/python -m pytest kfp_components/tests/test_goldens.py
"""

# No `from __future__ import annotations`: kfp reads the pipeline's annotations as objects.
import importlib.util
import os
from pathlib import Path

import pytest
import yaml
from kfp import compiler, components, dsl

import cairn_kfp

HERE = Path(__file__).resolve().parents[1]
UPDATE = os.environ.get("CAIRN_UPDATE_GOLDENS") == "1"
READY = {"train": cairn_kfp.train, "batch_inference": cairn_kfp.batch_inference}


def _body(path: Path) -> str:
    """The YAML without kfp's leading comment block (it prints dict defaults in an order that
    varies from run to run)."""
    return "\n".join(line for line in path.read_text().splitlines()
                     if not line.startswith("#"))


def check(generated: Path, golden: Path) -> None:
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(generated.read_text())
    assert golden.exists(), f"{golden} is missing; run with CAIRN_UPDATE_GOLDENS=1"
    assert _body(generated) == _body(golden), (
        f"{golden.relative_to(HERE)} differs from what the code generates; if the change is "
        "meant, rerun with CAIRN_UPDATE_GOLDENS=1 and review the diff")


@pytest.mark.parametrize("name", sorted(READY))
def test_component_yaml_is_current(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.yaml"
    compiler.Compiler().compile(READY[name].component, str(path))
    check(path, HERE / "specs" / f"{name}.yaml")


def _examples():
    spec = importlib.util.spec_from_file_location("cairn_kfp_examples",
                                                  HERE / "examples/pipelines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compiled_examples_are_current(tmp_path: Path) -> None:
    for path in _examples().compile_all(tmp_path):
        check(path, HERE / "examples/compiled" / path.name)


def test_component_yaml_loads_and_compiles_with_call(tmp_path: Path) -> None:
    loaded = components.load_component_from_file(str(HERE / "specs/train.yaml"))

    @dsl.pipeline
    def p() -> dict:
        return cairn_kfp.call(loaded, entrypoint="pkg.mod:main", cairn_store="/s").output

    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(p, str(path))
    params = yaml.safe_load(path.read_text())["root"]["dag"]["tasks"]["train"]["inputs"][
        "parameters"]
    assert params["cairn_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert params["cairn_task_name"]["runtimeValue"]["constant"] == "{{$.pipeline_task_name}}"
