"""The FAKE NVIDIA driver (native/fakecuda/fakecuda.c, built by ``make fakecuda``) set up for a
test: its shared state directory, this node's GPUs, what it records, and workloads that register
with it. Tests go through cairn's real ctypes path against it; no GPU is involved."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "native" / "fakecuda" / "fakecuda.c"
LIBRARY = ROOT / ".cache" / "fakecuda" / "libfakecuda.so"

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GIB = 1 << 30
UUID_A = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
UUID_B = "GPU-bbbbbbbb-0000-1111-2222-333333333333"
UUID_C = "GPU-cccccccc-0000-1111-2222-333333333333"


def fake_library() -> Path:
    """The fake's path, built (``make fakecuda``) when missing or older than its source; skips
    the test where it cannot be built (no gcc or make)."""
    if not LIBRARY.exists() or LIBRARY.stat().st_mtime < SOURCE.stat().st_mtime:
        if shutil.which("make") is None or shutil.which("gcc") is None:
            pytest.skip("the fake CUDA driver needs gcc and make (scripts/install_test_tools.sh)")
        # TOOLS_STAMP= : build the fake only; installing test tools is make test's business.
        subprocess.run(["make", "-s", "-C", str(ROOT), "fakecuda", "TOOLS_STAMP="], check=True,
                       timeout=120, stdin=subprocess.DEVNULL)
        if not LIBRARY.exists():
            pytest.skip("make fakecuda did not build the fake CUDA driver")
    return LIBRARY


@dataclass(frozen=True)
class Gpu:
    uuid: str
    name: str = H100
    total: int = 80 * GIB
    used: int = 0
    cc: str = "9.0"
    mig: int = 0

    def spec(self) -> str:
        return f"{self.uuid},{self.name},{self.total},{self.used},{self.cc},{self.mig}"


class FakeDriver:
    """One test's fake driver: the environment that configures it (``env``, also put into this
    process's environment by the fixture) and what it recorded."""

    def __init__(self, base: Path, library: Path) -> None:
        self.library = library
        self.state_dir = base / "fakecuda-state"
        self.state_dir.mkdir()
        self.record_file = base / "fakecuda-calls.jsonl"
        self.env: dict[str, str] = {
            "CAIRN_CUDA_LIBRARY": str(library), "CAIRN_NVML_LIBRARY": str(library),
            "FAKECUDA_STATE_DIR": str(self.state_dir), "FAKECUDA_RECORD": str(self.record_file),
            "FAKECUDA_DRIVER": "580.65.06", "FAKECUDA_GPUS": Gpu(UUID_A).spec()}

    def gpus(self, *gpus: Gpu) -> dict[str, str]:
        return {"FAKECUDA_GPUS": ";".join(g.spec() for g in gpus)}

    def calls(self, *names: str) -> list[dict]:
        """The recorded calls (all, or those named), oldest first."""
        if not self.record_file.exists():
            return []
        rows = [json.loads(line) for line in self.record_file.read_text().splitlines()]
        return [r for r in rows if not names or r["call"] in names]

    def state(self, pid: int) -> int:
        """The fake's CUprocessState for ``pid`` (its state file's first line)."""
        return int((self.state_dir / str(pid)).read_text().split()[0])

    def gpus_of(self, pid: int) -> list[str]:
        """The UUIDs the fake holds ``pid``'s device memory on."""
        lines = (self.state_dir / str(pid)).read_text().splitlines()[1:]
        return [line.split()[0] for line in lines]


REGISTER = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
if lib.fakecudaRegister(sys.argv[2].encode()) != 0:
    sys.exit("fakecudaRegister failed")
print("registered", flush=True)
sys.stdin.read()
"""


class Workload:
    """A process that registered with the fake (device memory per GPU) and waits on stdin."""

    def __init__(self, driver: FakeDriver, memory: Mapping[str, int],
                 env: Mapping[str, str]) -> None:
        spec = ",".join(f"{u}={b}" for u, b in memory.items())
        self.proc = subprocess.Popen([sys.executable, "-c", REGISTER, str(driver.library), spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **env}, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "registered", line
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


@pytest.fixture()
def fake_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """A fresh FAKE driver for the test; its settings are in this process's environment."""
    driver = FakeDriver(tmp_path, fake_library())
    for name, value in driver.env.items():
        monkeypatch.setenv(name, value)
    return driver


@pytest.fixture()
def workloads(fake_driver: FakeDriver) -> Iterator[Callable[..., Workload]]:
    """Starts processes registered with the fake: ``workloads({UUID_A: 2 * GIB})``."""
    started: list[Workload] = []

    def start(memory: Mapping[str, int], **env: str) -> Workload:
        w = Workload(fake_driver, memory, env)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def set_env(monkeypatch: pytest.MonkeyPatch, values: Mapping[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def pairs_received(driver: FakeDriver) -> list[Sequence[Sequence[str]]]:
    """The gpuPairs of every cuCheckpointProcessRestore the fake received, in order."""
    return [c["pairs"] for c in driver.calls("cuCheckpointProcessRestore")]

