"""Each concept of the runtime contract is written once: no ``CAIRN_`` environment name, no
exit-code definition and no outcome mapping outside ``cairn/runtime`` (tests exempt), and the
environment table in ``docs/environment.md`` is the one the code defines."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from cairn.runtime import env

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [ROOT / "cairn", ROOT / "providers" / "cairn_airflow" / "cairn_airflow",
           ROOT / "kfp_components" / "cairn_kfp"]
RUNTIME = ROOT / "cairn" / "runtime"
ENV_NAME = re.compile(r"\bCAIRN_[A-Z][A-Z0-9_]*")
EXIT_NUMBERS = {75, 76}  # only cairn's own codes are unambiguous as bare numbers
OUTCOME_MEMBERS = {"SUCCEEDED", "FAILED", "PREEMPTED", "EVICTED", "FENCED"}


def modules() -> Iterator[Path]:
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            if RUNTIME not in path.parents:
                yield path


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of string constants that are docstrings (prose may name a variable)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"


def test_no_cairn_environment_name_outside_the_runtime_layer() -> None:
    found = []
    for path in modules():
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in skip and ENV_NAME.search(node.value)):
                found.append(f"{where(path, node)} {ENV_NAME.search(node.value).group(0)}")
    assert found == []


def test_no_exit_code_defined_outside_the_runtime_layer() -> None:
    found = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id.startswith("EXIT_") for t in node.targets):
                found.append(f"{where(path, node)} defines an exit code")
            if (isinstance(node, ast.Constant) and type(node.value) is int
                    and node.value in EXIT_NUMBERS):
                found.append(f"{where(path, node)} writes exit code {node.value}")
    assert found == []


def test_no_outcome_mapping_outside_the_runtime_layer() -> None:
    """A module that names a try-ending exception and an outcome kind is mapping one to the
    other: that mapping lives in :mod:`cairn.runtime.session` (tests/unit/runtime/
    test_session.py checks inside the runtime layer too)."""
    found = []
    for path in modules():
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        kinds = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "OutcomeKind"}
        built = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == "Outcome"]
        if {"Preempted", "Fenced"} & names and kinds & OUTCOME_MEMBERS:
            found.append(f"{path.relative_to(ROOT)} maps errors to outcomes")
        if built and "store" not in path.relative_to(ROOT).parts[:2]:
            found.append(f"{where(path, built[0])} builds an outcome record")
    assert found == []


def test_every_contract_name_is_in_the_namespace_and_unique() -> None:
    names = [v.name for v in env.ALL]
    assert len(names) == len(set(names))
    assert all(env.is_cairn_name(n) and ENV_NAME.fullmatch(n) for n in names)


def test_the_documented_table_is_the_defined_one() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text()
    table = doc.split("<!-- BEGIN GENERATED TABLE -->\n", 1)[1].split("<!-- END", 1)[0]
    assert table == env.markdown_table()


def test_get_reads_the_environment_and_falls_back_to_the_default() -> None:
    assert env.STORE.get({"CAIRN_STORE": "gs://b/p"}) == "gs://b/p"
    assert env.STORE.get({"CAIRN_STORE": ""}) is None
    assert env.WORKDIR.get({}) == env.WORKDIR.default
