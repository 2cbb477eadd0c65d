"""The README's complete Python examples run as written (paths moved into a temporary
directory): the store API and resumable torch training, killed and run again."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def block(starting_with: str) -> str:
    blocks = [b for b in BLOCK.findall((ROOT / "README.md").read_text())
              if b.startswith(starting_with)]
    assert len(blocks) == 1, f"one README example starts with {starting_with!r}"
    return blocks[0]


def run(code: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    code = code.replace("file:///data/cairn", f"file://{tmp}/store").replace("/tmp/", f"{tmp}/")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=HANG_S, cwd=tmp)


def test_the_store_example_runs(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.bin").write_bytes(b"w" * 100_000)
    code = block("from cairn import Key, open_store")
    check = "\nprint(' '.join(r.kind.value for r in store.history(attempt.key)))"
    first = run(code + check, tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[-1] == "done"  # committed, then marked done
    assert not (tmp_path / "resume").exists()  # nothing to resume the first time


@pytest.mark.slow
def test_the_torch_example_resumes_after_a_kill(tmp_path: Path) -> None:
    code = block("import torch\nimport cairn\n")
    assert "cairn.Checkpointer(" in code
    # Stop the first run right after step 42 as a SIGKILL would, once snapshots were taken.
    killed = code.replace("    ckpt.step(step)",
                          "    ckpt.step(step)\n    if step == 42 and start == 0:\n"
                          "        ckpt.close(); import os; os._exit(9)")
    first = run(killed, tmp_path)
    assert first.returncode == 9, first.stderr
    second = run(code.replace("for step in range(start, 100):",
                              "print('start', start)\nfor step in range(start, 100):"), tmp_path)
    assert second.returncode == 0, second.stderr
    assert "start 40" in second.stdout  # every_steps=10: the snapshot of step 39


def test_the_dcp_example_loads_the_torch_example_s_snapshot(tmp_path: Path) -> None:
    torch_code = block("import torch\nimport cairn\n")
    killed = torch_code.replace("    ckpt.step(step)", "    ckpt.step(step)\n    if step == 42:\n"
                                "        ckpt.close(); import os; os._exit(9)")
    assert run(killed, tmp_path).returncode == 9
    code = block("import torch\nimport cairn.dcp")
    check = ("\nfrom cairn.state.checkpointer import load_state\nfrom cairn import open_store\n"
             "s = open_store('/tmp/cairn-torch')\n"
             "saved = load_state(s, s.manifest(cairn.Key.parse('my-dag/train/run-1/0')))\n"
             "assert torch.equal(model.weight, saved['models']['default']['weight'])\n"
             "assert torch.equal(model.bias, saved['models']['default']['bias'])\n")
    loaded = run(code + check, tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert "model of step 39 loaded from seq" in loaded.stdout


def test_the_encrypted_store_example_runs(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.bin").write_bytes(b"readme-marker" * 10_000)
    (script,) = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(),
                                       re.S) if b.startswith("cairn secret new")]
    script = script.replace("/tmp/", f"{tmp_path}/")
    bin_dir = str(Path(sys.executable).parent)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                          text=True, timeout=HANG_S, cwd=tmp_path,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    restored = tmp_path / "restored-sealed" / "model.bin"
    assert restored.read_bytes() == (tmp_path / "ckpt" / "model.bin").read_bytes()
    for path in (tmp_path / "cairn-sealed").rglob("*"):
        if path.is_file():
            assert b"readme-marker" not in path.read_bytes(), path
