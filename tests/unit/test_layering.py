"""Imports only point down the layers of ADR 0018, packages form no cycle, and no private name
crosses a package boundary.

Every module of ``cairn/``, ``cairn_airflow`` and ``cairn_kfp`` is parsed with :mod:`ast`:
module-level imports, function-local ones, ``TYPE_CHECKING`` blocks and
``importlib.import_module("...")`` strings all count. Tests are exempt.
"""

from __future__ import annotations

import ast
import importlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "cairn": ROOT / "cairn",
    "cairn_airflow": ROOT / "providers" / "cairn_airflow" / "cairn_airflow",
    "cairn_kfp": ROOT / "kfp_components" / "cairn_kfp",
}

#: ADR 0018, lowest first. A package may import its own layer's package and any lower layer;
#: packages that share a layer are peers and import neither each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cairn.exceptions", "cairn.version"),
    ("cairn.store",),
    ("cairn.runtime",),
    ("cairn.process", "cairn.state"),
    ("cairn.policy", "cairn.dcp"),
    ("cairn.k8s",),
    ("cairn.tries",),  # the try object: every integration's lifecycle
    ("cairn.integrations", "cairn.cli"),
    ("cairn", "cairn.__main__"),  # the top-level public API (cairn/__init__.py); python -m cairn
    ("cairn_airflow", "cairn_kfp"),
)
RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}

#: What the integrations may import: the public API (the top-level package and the package
#: facades whose ``__all__`` the README documents: ``cairn.store``, ``cairn.policy``,
#: ``cairn.k8s``, ``cairn.dcp``; never their modules), the errors, the runtime layer and the
#: try object.
PUBLIC_PACKAGES = frozenset({"cairn", "cairn.store", "cairn.policy", "cairn.k8s", "cairn.dcp"})
PUBLIC_PREFIXES = ("cairn.exceptions", "cairn.runtime", "cairn.tries")


@dataclass(frozen=True)
class Import:
    module: str     # the importing module, dotted
    target: str     # the imported module, dotted
    names: tuple[str, ...]
    line: int

    @property
    def source_package(self) -> str:
        return package_of(self.module)

    @property
    def target_package(self) -> str:
        return package_of(self.target)


def package_of(module: str) -> str:
    """The layered package a dotted module belongs to."""
    parts = module.split(".")
    if parts[0] != "cairn":
        return parts[0]
    if len(parts) == 1:
        return "cairn"
    return "cairn." + parts[1]


def module_name(top: str, path: Path) -> str:
    rel = path.relative_to(SOURCES[top]).with_suffix("")
    parts = [top, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(top: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module_name(top, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield Import(module, target, tuple(a.name for a in node.names), node.lineno)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield Import(module, node.args[0].value, (), node.lineno)


def all_imports() -> list[Import]:
    found = []
    for top, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            found += [i for i in imports_of(top, path) if i.target.split(".")[0] in SOURCES]
    return found


def submodule_names(target: str, names: tuple[str, ...]) -> list[str]:
    """``from cairn.store import keys`` imports the module ``cairn.store.keys`` (unless the
    package exports a name ``keys`` of its own in ``__all__``)."""
    exported = package_all(target)
    return [f"{target}.{n}" for n in names if n not in exported and _is_module(f"{target}.{n}")]


def package_all(dotted: str) -> frozenset[str]:
    """The names in a package's ``__all__`` (empty for a module or a package without one)."""
    top, *rest = dotted.split(".")
    init = SOURCES[top].joinpath(*rest, "__init__.py") if top in SOURCES else None
    if init is None or not init.exists():
        return frozenset()
    for node in ast.parse(init.read_text()).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in node.targets)):
            try:
                return frozenset(ast.literal_eval(node.value))
            except ValueError:  # computed (cairn's own): the package is light to import
                return frozenset(importlib.import_module(dotted).__all__)
    return frozenset()


def _is_module(dotted: str) -> bool:
    top, *rest = dotted.split(".")
    if top not in SOURCES:
        return False
    base = SOURCES[top].joinpath(*rest)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def cross_package(imports: list[Import]) -> list[Import]:
    out = []
    for i in imports:
        targets = [i.target] + submodule_names(i.target, i.names)
        for t in targets:
            edge = Import(i.module, t, i.names, i.line)
            if edge.source_package != edge.target_package:
                out.append(edge)
    return out


IMPORTS = all_imports()
EDGES = cross_package(IMPORTS)


def test_every_package_has_a_layer() -> None:
    packages = {e.source_package for e in EDGES} | {e.target_package for e in EDGES}
    assert sorted(p for p in packages if p not in RANK) == []


def describe(edge: Import) -> str:
    return f"{edge.module}:{edge.line} imports {edge.target}"


def test_imports_only_point_down_the_layers() -> None:
    upward = [describe(e) for e in EDGES
              if e.target_package in RANK and e.source_package in RANK
              and RANK[e.target_package] >= RANK[e.source_package]]
    assert upward == []


def test_no_cycles_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for e in EDGES:
        graph.setdefault(e.source_package, set()).add(e.target_package)
    for a, b in itertools.permutations(graph, 2):
        if b in graph.get(a, ()) and a in graph.get(b, ()):
            pytest.fail(f"{a} and {b} import each other")
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            pytest.fail("import cycle: " + " -> ".join(path + [node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_no_private_name_crosses_a_package() -> None:
    private = [f"{describe(e)} ({', '.join(n for n in e.names if n.startswith('_'))})"
               for e in EDGES
               if any(n.startswith("_") and not n.startswith("__") for n in e.names)
               and not _is_module(f"{e.target}.{e.names[0]}")]
    assert private == []


def is_public_for_integrations(edge: Import) -> bool:
    if edge.target in PUBLIC_PACKAGES:
        exported = package_all(edge.target) if edge.target != "cairn" else None
        return exported is None or not exported or set(edge.names) <= exported
    return any(edge.target == p or edge.target.startswith(p + ".") for p in PUBLIC_PREFIXES)


def test_integrations_import_only_the_public_api_and_the_runtime_layer() -> None:
    below = [describe(e) + f" {list(e.names)}" for e in EDGES
             if e.source_package in ("cairn_airflow", "cairn_kfp")
             and e.target.split(".")[0] == "cairn" and not is_public_for_integrations(e)]
    assert below == []


def module_graph(imports: list[Import]) -> dict[str, set[str]]:
    """Which module imports which, inside each package (every kind of import above counts,
    ``TYPE_CHECKING`` and function-local ones too). ``from pkg import sub`` is an edge to the
    module ``pkg.sub`` only; to ``pkg`` itself (its ``__init__``) when a name it imports is not
    a submodule, or for ``import pkg``."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        subs = submodule_names(i.target, i.names)
        targets = set(subs)
        if not i.names or len(subs) < len(i.names):
            targets.add(i.target)
        for t in targets:
            if t != i.module and package_of(t) == package_of(i.module):
                graph.setdefault(i.module, set()).add(t)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_no_module_cycles_inside_a_package() -> None:
    assert import_cycles(module_graph(IMPORTS)) == []


def test_the_cycle_check_sees_a_cycle_through_a_type_checking_import() -> None:
    planted = IMPORTS + [Import("cairn.store.keys", "cairn.store.store", ("Store",), 1)]
    assert ["cairn.store.keys", "cairn.store.store"] in [
        [m for m in c if m in ("cairn.store.keys", "cairn.store.store")]
        for c in import_cycles(module_graph(planted))]
