"""`make test`'s layout (ADR 0038) stays true to the tests it runs, and the newest end of the
dependency range is compared with constraints.txt the way scripts/newest_resolution.py says."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]
_MARK = {name: re.compile(rf"mark\.{name}\b|pytestmark\s*=.*\b{name}\b") for name in ("isolated", "exclusive")}


def _make(variable: str) -> str:
    """A variable's value as make expands it (``make print-VAR``)."""
    return subprocess.run(["make", "--no-print-directory", "-s", f"print-{variable}"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout.strip()


def _suite_test_files(suite: str) -> list[Path]:
    folder = ROOT / _make(f"DIR_{suite}")
    files = []
    for path in (_make(f"PATHS_{suite}") or "tests").split():
        path = folder / path
        files += [path] if path.is_file() else sorted(path.rglob("test_*.py"))
    assert files, f"{suite}: no test files under {folder}"
    return files


def test_the_recipes_may_write_bytecode_whatever_the_callers_environment_says() -> None:
    """With PYTHONDONTWRITEBYTECODE set, every process of a suite compiled torch and Airflow
    from source again (2.3-2.5 s of CPU each); make's recipes run without it."""
    probe = "probe:\n\t@echo \"[$${PYTHONDONTWRITEBYTECODE-unset}]\"\n"
    out = subprocess.run(["make", "--no-print-directory", "-s", "-f", "Makefile", "-f", "-",
                          "probe"], cwd=ROOT, input=probe, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    assert out.strip() == "[unset]", out


@pytest.mark.parametrize("marker, listed_in", [("isolated", "ISOLATED_SUITES"),
                                               ("exclusive", "EXCLUSIVE_SUITES")])
def test_the_suites_listed_for_a_marker_are_those_whose_tests_use_it(marker: str, listed_in: str) -> None:
    using = {suite for suite in _make("SUITES").split()
             if any(_MARK[marker].search(f.read_text()) for f in _suite_test_files(suite))}
    assert using, f"no suite has a test marked {marker}: the search is broken"
    assert set(_make(listed_in).split()) == using, \
        f"Makefile {listed_in} must name the suites with tests marked {marker}: {sorted(using)}"


def test_no_test_module_assigns_pytestmark_twice() -> None:
    """The second assignment replaces the first, silently: the Celery module's marks once went
    that way."""
    twice = []
    for suite in _make("SUITES").split():
        for path in _suite_test_files(suite):
            tree = ast.parse(path.read_text())
            assigned = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                        and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
            if len(assigned) > 1:
                twice.append(f"{path.relative_to(ROOT)}: lines {[n.lineno for n in assigned]}")
    assert not twice, f"pytestmark assigned more than once (make it one list): {sorted(set(twice))}"


_WHERE_RAN = """
import os
from pathlib import Path

import pytest


@pytest.mark.parametrize("i", range(4))
def test_one(i):
    with open(Path(__file__).with_suffix(f".{i}.ran"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_the_airflow_suites_distribution_keeps_each_module_on_one_worker(tmp_path: Path) -> None:
    """The Airflow suite's modules share a stack per module or session (the scheduler stack,
    the Celery cluster): ``make test``'s distribution mode must keep a module's tests on one
    xdist worker, with the pytest and pytest-xdist installed here. (``--dist loadgroup`` with
    ``xdist_group`` marks did not, with pytest 9.2: every worker started its own cluster.)"""
    import sys

    for name in ("test_first.py", "test_second.py"):
        (tmp_path / name).write_text(_WHERE_RAN)
    mode = _make("DIST_airflow")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:randomly", "-n", "2", "--dist", mode, "-c", os.devnull,
                          "--rootdir", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S)
    assert run.returncode == 0, run.stdout + run.stderr
    for module in ("test_first", "test_second"):
        workers = {(tmp_path / f"{module}.{i}.ran").read_text() for i in range(4)}
        assert len(workers) == 1, f"--dist {mode} ran {module}'s tests on {sorted(workers)}"


def test_the_main_suite_collects_its_slow_tests_first() -> None:
    """With ``--dist worksteal`` the end of the collection is what runs last: a training run
    collected last made the main lane's tail (make test's longest part)."""
    import sys

    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-m", "not isolated and not exclusive",
                          "tests/unit/store/test_aligned.py", "tests/integration/store/test_dedup.py"],
                         capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
    assert run.returncode == 0, run.stdout + run.stderr
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    slow = [i for i, nodeid in enumerate(ids) if "test_200_mb_twice_then_ten_percent_changed" in nodeid]
    assert len(ids) > 10 and slow == [0], ids[:3]


def _newest_resolution():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("newest_resolution", ROOT / "scripts" / "newest_resolution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(*items: tuple[str, str], editable: str | None = None) -> dict:
    install = [{"metadata": {"name": name, "version": version}, "is_direct": False,
                "download_info": {"url": f"file:///wheels/{name}.whl", "archive_info": {}}}
               for name, version in items]
    if editable:
        install.append({"metadata": {"name": editable, "version": "0.1.0.dev0"}, "is_direct": True,
                        "download_info": {"url": "file:///work", "dir_info": {"editable": True}}})
    return {"install": install}


def test_the_newest_resolution_matches_pins_by_canonical_name_less_what_constraints_leave_out(
        tmp_path: Path) -> None:
    nr = _newest_resolution()
    pins = tmp_path / "constraints.txt"
    pins.write_text("# written by make constraints\nPyYAML==6.0.4\ntyping_extensions==4.15.0\n")
    report = _report(("pyyaml", "6.0.4"), ("typing-extensions", "4.15.0"), ("torch", "2.13.0+cpu"),
                     ("setuptools", "84.2.1"), editable="cairn-resume")
    assert nr.differences(nr.resolved_from_report(report), nr.read_pins(pins)) == []


def test_a_newer_release_or_a_package_on_one_side_only_is_a_difference(tmp_path: Path) -> None:
    nr = _newest_resolution()
    pins = tmp_path / "constraints.txt"
    pins.write_text("pyyaml==6.0.3\nold-dependency==1.0\n")
    resolved = nr.resolved_from_report(_report(("PyYAML", "6.0.4"), ("new-dependency", "2.0")))
    assert nr.differences(resolved, nr.read_pins(pins)) == [
        "new-dependency: newest 2.0, constraints (not pinned)",
        "old-dependency: newest (not needed), constraints 1.0",
        "pyyaml: newest 6.0.4, constraints 6.0.3",
    ]


def test_a_constraints_line_that_is_not_an_exact_pin_is_refused(tmp_path: Path) -> None:
    nr = _newest_resolution()
    pins = tmp_path / "constraints.txt"
    pins.write_text("pyyaml>=6\n")
    with pytest.raises(SystemExit, match=r"constraints.txt:1: expected NAME==VERSION"):
        nr.read_pins(pins)
