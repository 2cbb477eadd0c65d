"""The functions every generated component runs (called here directly, in this process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cairn.exceptions import ConfigError
from cairn.store import Key
from cairn import open_store
from cairn.store.slotlog import RecordKind
from cairn_kfp._runtime import _cairn_key, _cairn_run


def key(**overrides: object) -> str:
    args = {"run_id": "job-1", "task_name": "train", "loop_item": "", "key": "",
            "checkpoint_prefix": ""}
    args.update(overrides)
    return _cairn_key(**args)


def test_key_is_job_and_task_then_loop_item() -> None:
    assert key() == "job-1/train"
    assert key(loop_item="a/b") == "job-1/train/a%2Fb"  # one component, '/' encoded
    assert Key.parse(key(loop_item="a/b")).components == ("job-1", "train", "a/b")
    assert key(loop_item=7) == "job-1/train/7"
    assert key(loop_item={"b": 1, "a": [2]}) == 'job-1/train/{"a":[2],"b":1}'


def test_prefix_replaces_the_run_id_and_key_overrides_everything() -> None:
    assert key(checkpoint_prefix="team/exp-3") == "team/exp-3/train"
    assert key(key="shared/warmup", loop_item=3) == "shared/warmup"


@pytest.mark.parametrize("field", ["run_id", "task_name", "loop_item", "key",
                                   "checkpoint_prefix"])
def test_an_unresolved_placeholder_is_refused_never_a_key(field: str) -> None:
    with pytest.raises(ConfigError, match="never resolved.*whole value"):
        key(**{field: "run-{{$.pipeline_job_uuid}}"})


def test_no_identity_at_all_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="inside a pipeline"):
        key(run_id="", task_name="")


def test_run_without_a_checkpointer_sets_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("CAIRN_STORE", raising=False)
    monkeypatch.delenv("CAIRN_KEY", raising=False)
    seen = _cairn_run(lambda x: (x, os.environ["CAIRN_STORE"], os.environ["CAIRN_KEY"]),
                      {"x": 1}, None, store=str(tmp_path), key="j/t", options={})
    assert seen == (1, str(tmp_path), "j/t")
    # KFP keeps nothing across tries: each try says a rollback goes unnoticed (ADR 0049).
    assert capsys.readouterr().out.count("Kubeflow Pipelines keeps nothing from one try") == 1


def test_run_refuses_a_missing_store_and_unknown_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAIRN_STORE", raising=False)
    with pytest.raises(ConfigError, match="no cairn store"):
        _cairn_run(lambda: None, {}, None, store="", key="j/t", options={})
    with pytest.raises(ConfigError, match="unresolved"):
        _cairn_run(lambda: None, {}, None, store="{{$.x}}", key="j/t", options={})
    with pytest.raises(ConfigError, match="unknown cairn_options"):
        _cairn_run(lambda: None, {}, None, store="/tmp/x", key="j/t", options={"every": 3})


def _train(steps: int, ckpt: object, fail_at: int | None = None) -> int:
    import torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = ckpt.restore(model=model, optimizer=opt)
    for step in range(start, steps):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(step)
        if step == fail_at:
            raise RuntimeError("boom")
    return start


def test_run_with_a_checkpointer_resumes_then_marks_done(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    options = {"every_steps": 2.0, "persist": "inline"}  # KFP's dicts carry doubles
    with pytest.raises(RuntimeError, match="boom"):
        _cairn_run(_train, {"steps": 6, "fail_at": 4}, "ckpt", store=store, key="j/t",
                   options=options)
    start = _cairn_run(_train, {"steps": 6}, "ckpt", store=store, key="j/t", options=options)
    assert start == 4  # the snapshot after step 3
    with open_store(store) as s:
        history = s.history(Key.parse("j/t"))
    assert history[-1].kind is RecordKind.DONE
    assert [r.kind for r in history].count(RecordKind.OPEN) == 2


def test_keep_snapshots_leaves_the_key_resumable(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    options = {"every_steps": 2, "persist": "inline", "keep_snapshots": True}
    _cairn_run(_train, {"steps": 4}, "ckpt", store=store, key="j/t", options=options)
    assert _cairn_run(_train, {"steps": 4}, "ckpt", store=store, key="j/t",
                      options=options) == 4
