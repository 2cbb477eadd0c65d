"""The GPU inventory through pynvml's real ctypes path, against the FAKE driver's NVML
(native/fakecuda); the nvidia-smi fallback from its text."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.process import compat, gpus
from tests.support.fakecuda import (GIB, UUID_A, UUID_B, UUID_C, FakeDriver, Gpu, fake_driver,
                                    set_env, workloads)

__all__ = ["fake_driver", "workloads"]  # fixtures

pytest.importorskip("pynvml")


def test_nvml_reports_each_gpu_and_the_driver(fake_driver: FakeDriver, monkeypatch) -> None:
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_A, used=GIB), Gpu(UUID_B, cc="8.0", mig=1)))
    inv = gpus.inventory()
    assert inv.source is gpus.Source.NVML and inv.note == ""
    assert inv.driver == "580.65.06" and inv.cuda_driver == 13000 and inv.can_remap
    assert [(d.index, d.uuid, d.memory_total, d.memory_used, d.compute_capability, d.mig)
            for d in inv.devices] == [(0, UUID_A, 80 * GIB, GIB, "9.0", False),
                                      (1, UUID_B, 80 * GIB, 0, "8.0", True)]


def test_the_workloads_own_memory_where_its_pids_match(fake_driver, workloads,
                                                       monkeypatch) -> None:
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_A, used=GIB), Gpu(UUID_B)))
    mine, other = workloads({UUID_A: 3 * GIB, UUID_B: GIB}), workloads({UUID_A: 5 * GIB})
    inv = gpus.inventory()
    assert inv.devices[0].memory_used == 9 * GIB  # NVML's device-wide figure
    use = inv.use_of([mine.pid])
    assert use.matched and dict(use.per_gpu) == {UUID_A: 3 * GIB, UUID_B: GIB}
    # PIDs that match nothing (a container sees host PIDs): the device-wide figures.
    fallback = inv.use_of([1])
    assert not fallback.matched and fallback.total == 10 * GIB
    assert other.pid in inv.processes[UUID_A]


def test_an_old_driver_cannot_remap(fake_driver, monkeypatch) -> None:
    monkeypatch.setenv("FAKECUDA_DRIVER", "570.133.20")
    inv = gpus.inventory()
    assert inv.driver_major == 570 and not inv.can_remap and inv.cuda_driver == 12080


def test_no_nvml_and_no_nvidia_smi_is_an_empty_inventory(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CAIRN_NVML_LIBRARY", str(tmp_path / "no-libnvidia-ml.so.1"))
    monkeypatch.setenv("PATH", str(tmp_path))
    inv = gpus.inventory()
    assert inv.source is gpus.Source.NONE and inv.devices == ()
    assert "does not load" in inv.note


def test_visible_devices_follow_cuda_visible_devices() -> None:
    devs = tuple(gpus.GpuDevice(i, f"GPU-{c}{c}-0", "X", 1, 0) for i, c in enumerate("abc"))
    assert gpus.visible(devs, {}) == devs
    assert [d.index for d in gpus.visible(devs, {"CUDA_VISIBLE_DEVICES": "2,0"})] == [2, 0]
    assert [d.index for d in gpus.visible(devs, {"CUDA_VISIBLE_DEVICES": "GPU-bb,7,0"})] == [1]
    assert gpus.visible(devs, {"CUDA_VISIBLE_DEVICES": ""}) == ()


def test_nvidia_smi_text_is_the_fallback() -> None:
    text = ("0, GPU-aa, NVIDIA H100 80GB HBM3, 81559, 1024, 580.65.06, 9.0, Disabled\n"
            "1, GPU-bb, Some, GPU, 4096, [N/A], 580.65.06, [N/A], [N/A]\n")
    devices, driver = gpus.parse_smi(text)
    assert driver == "580.65.06"
    assert devices[0] == gpus.GpuDevice(0, "GPU-aa", "NVIDIA H100 80GB HBM3", 81559 << 20,
                                        1024 << 20, "9.0", False)
    assert devices[1].name == "Some, GPU" and devices[1].memory_used == 0
    assert devices[1].compute_capability is None


def test_the_compatibility_record_holds_uuids_and_remaps(fake_driver, monkeypatch,
                                                         tmp_path: Path) -> None:
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_A)))
    argv = ["python", "t.py"]
    stored = compat.with_gpu_use(compat.current_record(argv, cwd=str(tmp_path), criu=None),
                                 {UUID_A: 2 * GIB})
    assert stored["gpus"] == [{"uuid": UUID_A, "name": "NVIDIA H100 80GB HBM3",
                               "memory_total": 80 * GIB, "memory_used": 0,
                               "workload_bytes": 2 * GIB}]
    assert stored["nvidia_driver"] == "580.65.06" and stored["cuda"] == "13.0"
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_B)))  # the retry's node
    here = compat.current_record(argv, cwd=str(tmp_path), criu=None)
    assert compat.differences(stored, here) == []
    assert compat.gpu_plan(stored, here).pairs == ((UUID_A, UUID_B),)
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_B, used=79 * GIB)))
    full = compat.current_record(argv, cwd=str(tmp_path), criu=None)
    assert compat.differences(stored, full) == [
        f"GPU {UUID_B} has 1.0 GiB free and the snapshot holds 2.0 GiB of device memory for it"]


def test_only_the_gpus_a_snapshot_holds_memory_on_are_mapped(fake_driver, monkeypatch,
                                                             tmp_path: Path) -> None:
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_A), Gpu(UUID_B)))
    argv = ["python", "t.py"]
    record = compat.current_record(argv, cwd=str(tmp_path), criu=None)
    one_gpu = compat.with_gpu_use(record, {UUID_B: GIB})  # the workload used the second
    set_env(monkeypatch, fake_driver.gpus(Gpu(UUID_C)))  # a node with one GPU
    here = compat.current_record(argv, cwd=str(tmp_path), criu=None)
    assert compat.gpu_plan(one_gpu, here).pairs == ((UUID_B, UUID_C),)
    assert compat.differences(one_gpu, here) == []
    # A snapshot without GPU state keeps the strict rule on models and count.
    assert compat.gpu_plan(record, here).pairs == ()
    assert compat.differences(record, here) == [
        "GPU models differs (snapshot: ['NVIDIA H100 80GB HBM3', 'NVIDIA H100 80GB HBM3'], "
        "here: ['NVIDIA H100 80GB HBM3'])", "GPU count differs (snapshot: 2, here: 1)"]


def test_mps_clients_are_listed_apart(fake_driver, workloads) -> None:
    plain = workloads({UUID_A: GIB})
    client = workloads({UUID_A: 2 * GIB}, FAKECUDA_MPS_CLIENT="1")
    inv = gpus.inventory()
    assert inv.mps_clients == {UUID_A: frozenset({client.pid})}
    assert plain.pid in inv.processes[UUID_A] and client.pid not in inv.processes[UUID_A]
