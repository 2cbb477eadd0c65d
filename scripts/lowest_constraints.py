"""Write a constraints file that pins every dependency pyproject.toml declares at its lowest
bound: ``name>=X`` becomes ``name==X`` (pip has no lowest-resolution mode).

Usage: ``python scripts/lowest_constraints.py --extras dev,gcs [--pin torch==2.13.0] > FILE``

The base dependencies and the named extras are read; a package named in several of them gets
the highest of its lower bounds (what all of them together allow at least). ``--pin`` replaces
a package's bound with a fixed version (torch: any release other than the one in this
machine's wheel cache is a download of several GB). A requirement with no ``>=`` bound (a
sibling distribution of this repository) is left to the resolver; any other specifier is
refused, so that a new form of bound is never silently left untested. Exact versions of the
packages they pull in are not pinned: the resolver takes the newest that fit.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")
_LOWER = re.compile(r"^>=\s*([0-9][0-9A-Za-z.]*)$")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def lowest_bounds(project: dict, extras: list[str]) -> dict[str, str]:
    """Package (canonical name) -> its lowest allowed version over the base dependencies and
    ``extras``. Raises SystemExit naming a requirement whose bound this script cannot read."""
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"pyproject.toml has no extra {', '.join(unknown)}")
    requirements = list(project.get("dependencies", []))
    for extra in extras:
        requirements += optional[extra]
    bounds: dict[str, str] = {}
    for text in requirements:
        match = _REQUIREMENT.match(text)
        if match is None:
            raise SystemExit(f"cannot read the requirement {text!r}")
        name, _extras, specifier, _marker = match.groups()
        if not specifier:
            continue  # a sibling distribution (cairn-kfp, airflow-provider-cairn)
        lower = _LOWER.match(specifier)
        if lower is None:
            raise SystemExit(f"{text!r}: only '>=X' bounds are understood; extend "
                             "scripts/lowest_constraints.py for this one")
        key = _canonical(name)
        if key not in bounds or _version_key(lower.group(1)) > _version_key(bounds[key]):
            bounds[key] = lower.group(1)
    return bounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="", help="comma-separated extras to include")
    parser.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                        help="pin a package at a fixed version instead of its bound")
    parser.add_argument("--pyproject", default=str(ROOT / "pyproject.toml"))
    args = parser.parse_args(argv)
    project = tomllib.loads(Path(args.pyproject).read_text())["project"]
    extras = [extra for extra in args.extras.split(",") if extra]
    bounds = lowest_bounds(project, extras)
    pins = {}
    for pin in args.pin:
        name, sep, version = pin.partition("==")
        if not sep or not version:
            raise SystemExit(f"--pin {pin!r}: give NAME==VERSION")
        pins[_canonical(name)] = version
    print(f"# Every dependency of cairn-resume[{','.join(extras)}] at the lowest version "
          "pyproject.toml allows,")
    print("# written by scripts/lowest_constraints.py; "
          + (f"pinned instead: {', '.join(args.pin)}" if args.pin else "nothing pinned instead"))
    for name in sorted(set(bounds) | set(pins)):
        print(f"{name}=={pins.get(name, bounds.get(name))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
