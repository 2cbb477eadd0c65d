"""A restore that fails on the task's side (an injected library failure, as cryptography
51's ``ValueError: data and buf must not overlap`` was) ends the task with exit 8 naming the
cause: no snapshot is skipped and every snapshot restores once the cause is gone (issue 32
item 4). The runtime every generated component runs, called here, then a real kfp.local run.

The injection is the main suite's ``tests/support/read_failure.py``, loaded by its path (this
suite's ``tests`` is not the repository's)."""

# No `from __future__ import annotations`: kfp reads a plain component's annotations as objects.

import importlib.util
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kfp import dsl

import cairn_kfp
from cairn.store import Key
from cairn import open_store
from cairn_kfp._runtime import _cairn_run

REPO = Path(__file__).resolve().parents[2]
KEY = "team/restore-failure/train"


def read_failure() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cairn_test_read_failure", REPO / "tests" / "support" / "read_failure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(steps: int, ckpt: Any) -> int:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = ckpt.restore(model=model, optimizer=opt)
    for step in range(start, steps):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(step)
    return start


def seqs_of(store: str) -> list[int]:
    with open_store(store, create=False) as opened:
        return [info.seq for info in opened.snapshots(Key.parse(KEY))]


def test_the_component_runtime_exits_8_and_skips_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = str(tmp_path / "store")
    options = {"every_steps": 2.0, "persist": "inline", "keep_snapshots": True}
    assert _cairn_run(_train, {"steps": 6}, "ckpt", store=store, key=KEY, options=options) == 0
    seqs = seqs_of(store)
    assert len(seqs) == 3  # after steps 1, 3 and 5

    helper = read_failure()
    undo = helper.install("part")
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as caught:
            _cairn_run(_train, {"steps": 8}, "ckpt", store=store, key=KEY, options=options)
    finally:
        undo()
    assert caught.value.code == 8
    assert f"ValueError: {helper.INJECTED}" in str(caught.value.__cause__)
    assert "skipping snapshot" not in caplog.text and "(exit 8)" in caplog.text
    assert seqs_of(store) == seqs
    assert _cairn_run(_train, {"steps": 8}, "ckpt", store=store, key=KEY, options=options) == 6


@pytest.mark.slow
def test_a_kfp_task_whose_restore_fails_on_its_side_fails_and_skips_nothing(
        local_kfp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    store_url, log = str(tmp_path / "store"), tmp_path / "train.log"

    @dsl.pipeline
    def training(store: str, arguments: dict) -> dict:
        return cairn_kfp.train(
            entrypoint="kfp_workloads:fit", arguments=arguments, cairn_store=store,
            cairn_key=KEY,
            cairn_options={"every_steps": 5, "persist": "inline", "keep_snapshots": True}).output

    def arguments(steps: int) -> dict:
        return {"steps": steps, "kill_at": -1, "marker": str(tmp_path / "m"), "log": str(log)}

    assert training(store=store_url, arguments=arguments(12)).output["resumed_step"] is None
    seqs = seqs_of(store_url)
    assert len(seqs) == 2  # after steps 4 and 9

    helper = read_failure()
    injected = helper.injecting_env(tmp_path / "inject")
    monkeypatch.setenv("PYTHONPATH", injected["PYTHONPATH"])
    monkeypatch.setenv(helper.WHERE_ENV, injected[helper.WHERE_ENV])
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="FAILURE"):
        training(store=store_url, arguments=arguments(16))
    printed = "".join(capfd.readouterr())
    assert f"ValueError: {helper.INJECTED}" in printed and "(exit 8)" in printed, printed[-3000:]
    assert "skipping snapshot" not in printed
    assert log.read_text().split().count("start") == 1  # the failed task trained nothing
    assert seqs_of(store_url) == seqs

    monkeypatch.delenv(helper.WHERE_ENV)
    out = training(store=store_url, arguments=arguments(16)).output
    assert out["resumed_step"] == 9 and out["result"]["start"] == 10
