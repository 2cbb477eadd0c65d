"""``cairn run`` of a CUDA training process: runs only where a GPU, its driver and CRIU exist
(skipped elsewhere; the suite's CI machines have no GPU)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.process.cuda import CudaCheckpoint
from tests.support.cairn_run import CairnRun, can_run_criu, descendants, gone, wait_for


def _gpu_ready() -> bool:
    if not can_run_criu() or shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():  # the CPU build of torch, or no usable GPU
        return False
    try:
        return CudaCheckpoint.load() is not None
    except Exception:  # noqa: BLE001 - an old driver: not ready
        return False


pytestmark = [pytest.mark.isolated, pytest.mark.slow,
              pytest.mark.skipif(not _gpu_ready(), reason="needs an NVIDIA GPU, driver >= 570, "
                                 "torch with CUDA, root and criu")]

SCRIPT = """
import sys, time, torch
torch.manual_seed(0)
dev = torch.device("cuda")
model = torch.nn.Linear(256, 256).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256, device=dev)
with open(sys.argv[1], "a") as m:
    for step in range(int(sys.argv[2])):
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        m.write(f"{step} {loss.item():.10f}\\n"); m.flush()
        time.sleep(0.05)
with open(sys.argv[3], "wb") as f:
    for p in model.parameters():
        f.write(p.detach().cpu().numpy().tobytes())
"""


def test_gpu_training_killed_and_resumed_bit_identical(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the metrics file is in the working directory, a track root
    script = tmp_path / "gpu_train.py"
    script.write_text(SCRIPT)
    ref_metrics, ref = tmp_path / "ref.txt", tmp_path / "ref.bin"
    subprocess.run([sys.executable, str(script), str(ref_metrics), "300", str(ref)], check=True,
                   timeout=600)
    metrics, out = tmp_path / "m.txt", tmp_path / "w.bin"
    command = [sys.executable, str(script), str(metrics), "300", str(out)]
    first = CairnRun(store=str(tmp_path / "store"), key="gpu", command=command,
                     workdir=tmp_path / "work", logs=tmp_path / "logs", every="3s")
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 40, 300,
             "training to start")
    before = len(first.committed())
    wait_for(lambda: len(first.committed()) > before or first.proc.poll() is not None, 300,
             "a GPU snapshot")
    assert first.proc.poll() is None, first.stderr
    tree = descendants(first.proc.pid)
    first.kill()
    wait_for(lambda: all(gone(p) for p in tree), 30, "the workload to die")
    second = CairnRun(store=str(tmp_path / "store"), key="gpu", command=command,
                      workdir=tmp_path / "work", logs=tmp_path / "logs", every="3s")
    assert second.wait(600) == 0, second.stderr
    assert "restored snapshot seq" in second.stderr
    assert metrics.read_text() == ref_metrics.read_text()
    assert out.read_bytes() == ref.read_bytes()
