"""scripts/gpu_bundle.sh, the carry bundle for the device check (issue 17 item 7), built here:
it downloads cp312 wheels from PyPI, so it is slow and needs the network. What it builds must
be importable by Python 3.12 on manylinux x86-64, CRIU must run from the bundle with its own
libraries, and the whole must fit the run tool's 64 MiB."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_bundle.sh"
CRIU = os.environ.get("CAIRN_CRIU") or shutil.which("criu") or "/usr/local/sbin/criu"

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not os.access(CRIU, os.X_OK), reason="needs a criu binary (make criu)"),
]

# A wheel the device's CPython 3.12 on x86-64 Linux installs: cp312, an abi3 one of 3.12 or
# older, or pure Python; manylinux no newer than 2_28.
TAG = re.compile(r"-(cp312-cp312|cp3(?:[2-9]|1[0-2])-abi3|py3-none)-(.+)\.whl$")


def _build(dest: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), str(dest)], capture_output=True, text=True,
                          timeout=300,
                          env={**os.environ, "CAIRN_CRIU": CRIU, "PYTHON": sys.executable, **env},
                          cwd=ROOT)


def test_the_bundle_builds_runs_criu_and_fits(tmp_path: Path) -> None:
    dest = tmp_path / "bundle"
    done = _build(dest)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = sorted(p.name for p in (dest / "wheels").iterdir())
    assert {w.split("-")[0] for w in wheels} == {"blake3", "cryptography", "cffi", "pycparser"}
    for wheel in wheels:
        m = TAG.search(wheel)
        assert m, wheel
        platforms = m.group(2).split(".")
        assert platforms == ["any"] or any(
            p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
            for p in platforms), wheel
    # CRIU runs from the bundle, with its libraries and none from this system's search path
    # but glibc's.
    version = subprocess.run([str(dest / "criu" / "criu"), "--version"], capture_output=True,
                             text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert version.returncode == 0 and "Version: 4.1" in version.stdout, version
    libs = subprocess.run(["ldd", str(dest / "criu" / "criu.bin")], capture_output=True,
                          text=True, env={"LD_LIBRARY_PATH": str(dest / "criu" / "lib")})
    outside = [line for line in libs.stdout.splitlines() if "=> /" in line
               and str(dest) not in line and not re.search(r"lib(c|m|pthread|dl|rt)\.so", line)]
    assert outside == [], outside
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    assert size < 64 << 20
    assert re.search(r"KiB of the 65536 KiB the run tool carries", done.stdout), done.stdout

    # activate.sh unpacks the wheels without pip and points cairn at the bundled CRIU.
    site = tmp_path / "site"
    shell = subprocess.run(
        ["bash", "-c", f"source {dest}/activate.sh && echo \"$CAIRN_CRIU\" && "
                       "echo \"$PYTHONPATH\""],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "CAIRN_BUNDLE_SITE": str(site)})
    assert shell.returncode == 0, shell.stderr
    criu, path = shell.stdout.split()
    assert criu == str(dest / "criu" / "criu") and path.split(":")[:2] == [str(ROOT), str(site)]
    for package in ("blake3", "cryptography", "cffi", "pycparser"):
        assert (site / package).is_dir(), package
    assert list(site.glob("_cffi_backend.cpython-312-x86_64-linux-gnu.so"))


def test_a_bundle_over_the_limit_fails_and_says_by_how_much(tmp_path: Path) -> None:
    done = _build(tmp_path / "bundle", GPU_BUNDLE_LIMIT=str(1 << 20))
    assert done.returncode == 1
    assert re.search(r"gpu_bundle: over the limit by \d+ KiB", done.stderr), done.stderr
