"""Tell whether the newest end of the dependency range is what a constraints file pins.

Usage: ``python scripts/newest_resolution.py --constraints constraints.txt --pin torch==2.13.0
-- PIP_INSTALL_ARGS...``

pip resolves PIP_INSTALL_ARGS with the newest releases they allow (``--dry-run
--ignore-installed --report``, in a throwaway venv: nothing is installed) with only ``--pin``
held fixed, as ``.venv-newest`` would. Exit 0 when every resolved package has exactly the version
the constraints file pins and the file pins nothing else: the main environment installs those
versions and its suite, a superset of the range tests, already runs on the newest end, so
``make test`` does not build and test the same set twice. Exit 1, listing each difference,
when they differ (a release came out after the file was written): then ``.venv-newest`` is
built and tested. Exit 2 when pip fails.

Left out of the comparison as the constraints file leaves them out
(scripts/refresh_constraints.sh): the editable checkouts (no version of their own on an
index), torch, which ``--pin`` fixes, and pip's own packaging tools.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_NOT_PINNED = frozenset({"pip", "setuptools", "wheel", "torch"})


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """Package (canonical name) -> version for every ``NAME==VERSION`` line of a constraints
    file; raises SystemExit naming a line of another form."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"{path}:{number}: expected NAME==VERSION, got {raw!r}")
        pins[_canonical(name.strip())] = version.strip()
    return pins


def resolved_from_report(report: dict) -> dict[str, str]:
    """Package (canonical name) -> version for what a ``pip install --report`` would install,
    less the editable checkouts and the packages left out of constraints files."""
    resolved: dict[str, str] = {}
    for item in report["install"]:
        if item.get("is_direct") and item.get("download_info", {}).get("dir_info", {}).get("editable"):
            continue
        name = _canonical(item["metadata"]["name"])
        if name not in _NOT_PINNED:
            resolved[name] = item["metadata"]["version"]
    return resolved


def differences(resolved: dict[str, str], pins: dict[str, str]) -> list[str]:
    """One line per package whose resolved version is not its pin, or that only one side has."""
    lines = []
    for name in sorted(resolved.keys() | pins.keys()):
        new, pinned = resolved.get(name), pins.get(name)
        if new != pinned:
            lines.append(f"{name}: newest {new or '(not needed)'}, constraints {pinned or '(not pinned)'}")
    return lines


def resolve_newest(pin: str, install_args: list[str]) -> dict:
    """pip's resolution of ``install_args`` with the newest releases allowed, ``pin`` fixed."""
    with tempfile.TemporaryDirectory() as tmp:
        venv, pin_file, report = Path(tmp) / "venv", Path(tmp) / "pin.txt", Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pin_file.write_text(pin + "\n")
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--dry-run",
                        "--ignore-installed", "--report", str(report), "-c", str(pin_file), pin,
                        *install_args], check=True)
        return json.loads(report.read_text())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--constraints", type=Path, required=True)
    parser.add_argument("--pin", required=True, help="held fixed, e.g. torch==2.13.0")
    parser.add_argument("install_args", nargs="+", help="what pip installs, after --")
    args = parser.parse_args(argv)
    pins = read_pins(args.constraints)
    try:
        report = resolve_newest(args.pin, args.install_args)
    except subprocess.CalledProcessError as exc:
        print(f"newest_resolution: pip failed ({exc.returncode}) resolving {args.install_args}",
              file=sys.stderr)
        return 2
    diff = differences(resolved_from_report(report), pins)
    if diff:
        print(f"newest_resolution: the newest releases differ from {args.constraints}:", *diff,
              sep="\n  ", file=sys.stderr)
        return 1
    print(f"newest_resolution: the newest releases are exactly what {args.constraints} pins "
          f"({len(pins)} packages)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
