from __future__ import annotations

import sys
from pathlib import Path

from cairn.process.compat import current_record, differences, script_files


def test_script_hash_covers_the_script_not_its_data_files(tmp_path: Path) -> None:
    script, data = tmp_path / "train.py", tmp_path / "metrics.txt"
    script.write_text("print(1)\n")
    data.write_text("0\n")
    argv = [sys.executable, "train.py", "--metrics", "metrics.txt"]
    files = script_files(argv, str(tmp_path))
    assert list(files) == ["train.py"]
    data.write_text("0\n1\n")
    assert script_files(argv, str(tmp_path)) == files
    script.write_text("print(2)\n")
    assert script_files(argv, str(tmp_path)) != files
    assert script_files([sys.executable, "-m", "pkg", "train.py"], str(tmp_path)) == {}


def test_shebang_program_is_the_script(tmp_path: Path) -> None:
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/sh\necho hi\n")
    job.chmod(0o755)
    assert list(script_files([str(job), "x"], str(tmp_path))) == [str(job)]


def test_differences_name_every_mismatch(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("a")
    here = current_record([sys.executable, "t.py"], cwd=str(tmp_path), criu=None, env={})
    assert differences(here, here) == []
    # A flag no CPU has: one this host has would be no difference (avx512f once was).
    other = {**here, "kernel": "5.4.0", "cpu_flags": here["cpu_flags"] + " cairn_test_flag",
             "image_digest": "sha256:aa"}
    reasons = differences(other, here)
    assert any("kernel differs" in r for r in reasons)
    assert any("missing here: cairn_test_flag" in r for r in reasons)
    assert any("container image differs" in r for r in reasons)
    (tmp_path / "t.py").write_text("b")
    changed = current_record([sys.executable, "t.py"], cwd=str(tmp_path), criu=None, env={})
    assert differences(here, changed) == ["t.py changed since the snapshot (content hash differs)"]
    moved = {**here, "workload": {**here["workload"], "argv": [sys.executable, "u.py"]}}
    assert "the command changed" in differences(moved, here)[0]
