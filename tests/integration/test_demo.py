"""`make demo`'s script runs end to end and shows what the README says it shows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hang import HANG_S

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_script(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "demo.sh", work / "scripts" / "demo.sh")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", "scripts/demo.sh"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "32.0 MiB (32.0 MiB new)" in out
    assert "32.0 MiB (4.0 MiB new)" in out, "the second put writes only the changed 4 MiB"
    assert "BAD: digest mismatch" in out and "exit code 4" in out
    assert 'restored progress: {"step": 100}' in out
    assert "skipped snapshot seq 4" in proc.stderr
