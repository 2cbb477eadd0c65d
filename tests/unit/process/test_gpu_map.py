"""Which GPU here each snapshot GPU restores onto: pure, from compatibility records."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.process.gpu_map import GpuPlan, parse_gpu_map, plan

GIB = 1 << 30
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def snap(uuid: str, *, name: str = H100, held: int = 4 * GIB) -> dict:
    return {"uuid": uuid, "name": name, "memory_total": 80 * GIB, "workload_bytes": held}


def here(uuid: str, *, name: str = H100, used: int = 0) -> dict:
    return {"uuid": uuid, "name": name, "memory_total": 80 * GIB, "memory_used": used}


def test_the_same_gpus_need_no_pairs_on_any_driver() -> None:
    assert plan([snap("GPU-a")], [here("GPU-a")], driver="570.86.10") == GpuPlan()


def test_an_explicit_identity_map_is_sent_on_580_only() -> None:
    identity = {"GPU-a": "GPU-a"}
    assert plan([snap("GPU-a")], [here("GPU-a")], driver="580.65.06",
                gpu_map=identity).pairs == (("GPU-a", "GPU-a"),)
    assert plan([snap("GPU-a")], [here("GPU-a")], driver="570.86.10",
                gpu_map=identity) == GpuPlan()


def test_other_uuids_map_in_visible_order_on_580() -> None:
    got = plan([snap("GPU-a"), snap("GPU-b")], [here("GPU-y"), here("GPU-x"), here("GPU-z")],
               driver="580.65.06")
    assert got == GpuPlan(pairs=(("GPU-a", "GPU-y"), ("GPU-b", "GPU-x")))


def test_the_override_picks_targets_and_the_rest_follow_in_order() -> None:
    got = plan([snap("GPU-a"), snap("GPU-b")], [here("GPU-x"), here("GPU-y")],
               driver="580.65.06", gpu_map={"GPU-a": "GPU-y"})
    assert got.pairs == (("GPU-a", "GPU-y"), ("GPU-b", "GPU-x"))


@pytest.mark.parametrize(("snapshot", "visible", "driver", "gpu_map", "reason"), [
    ([snap("GPU-a")], [here("GPU-x")], "570.86.10", {}, "driver 570.86.10 cannot restore onto "
     "other GPUs"),
    ([snap("GPU-a")], [here("GPU-x", name=A100)], "580.65.06", {}, "the same chip only"),
    ([snap("GPU-a"), snap("GPU-b")], [here("GPU-x")], "580.65.06", {},
     "ran on 2 GPU(s) and 1 are visible"),
    ([snap("GPU-a", held=10 * GIB)], [here("GPU-x", used=75 * GIB)], "580.65.06", {},
     "has 5.0 GiB free and the snapshot holds 10.0 GiB"),
    ([snap("GPU-a")], [here("GPU-x")], "580.65.06", {"GPU-a": "GPU-q"}, "not visible here"),
    ([snap("GPU-a")], [here("GPU-x")], "580.65.06", {"GPU-q": "GPU-x"}, "did not run on"),
])
def test_impossible_remaps_give_one_line(snapshot, visible, driver, gpu_map, reason) -> None:
    got = plan(snapshot, visible, driver=driver, gpu_map=gpu_map)
    assert got.pairs == () and reason in got.reason and "\n" not in got.reason


def test_the_map_setting_is_parsed_strictly() -> None:
    assert parse_gpu_map("GPU-a=GPU-x, GPU-b=GPU-y") == {"GPU-a": "GPU-x", "GPU-b": "GPU-y"}
    assert parse_gpu_map("") == {} and parse_gpu_map(None) == {}
    for bad in ("GPU-a", "a=b", "GPU-a=GPU-x,GPU-a=GPU-y", "GPU-a=GPU-x,GPU-b=GPU-x"):
        with pytest.raises(ConfigError, match="CAIRN_GPU_MAP"):
            parse_gpu_map(bad)
