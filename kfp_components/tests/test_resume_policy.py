"""The resume policy under real kfp.local runs (SubprocessRunner, kfp.local's own retries):
each try is planned by :class:`cairn.tries.Try` from the key's history."""

# No `from __future__ import annotations`: kfp reads a plain component's annotations as objects.

from pathlib import Path

import pytest
from kfp import dsl

import cairn_kfp
from cairn import open_store
from cairn_kfp.kubernetes import set_retries

pytestmark = pytest.mark.slow

EVERY, FAIL_AT, STEPS = 5, 12, 16


def _starts(log: Path) -> list[int]:
    words = log.read_text().split()
    return [int(n) for word, n in zip(words[::2], words[1::2]) if word == "start"]


def _train(store: str, marker: str, log: str, options: dict, retries: int):  # type: ignore[no-untyped-def]
    task = cairn_kfp.train(
        entrypoint="kfp_workloads:fit_with_a_bug",
        arguments={"steps": STEPS, "fail_at": FAIL_AT, "marker": marker, "log": log},
        cairn_store=store, cairn_options={"every_steps": EVERY, "persist": "inline", **options})
    set_retries(task, retries, backoff="0s")
    return task


def test_after_its_own_error_a_try_starts_fresh_with_resume_on_preemption(
        local_kfp: Path, tmp_path: Path) -> None:
    store_url, marker, log = str(tmp_path / "store"), tmp_path / "failed", tmp_path / "train.log"

    @dsl.pipeline
    def training(store: str) -> dict:
        return _train(store, str(marker), str(log), {"resume_on": "preemption"}, 1).output

    out = training(store=store_url).output

    assert marker.exists()  # the first try failed with its own error, after snapshots
    assert _starts(log) == [0, 0]  # ... so the retry did not restore them
    assert out["result"]["start"] == 0 and out["resumed_step"] is None


def test_a_crash_loop_stops_at_max_error_retries(local_kfp: Path, tmp_path: Path) -> None:
    store_url, log = str(tmp_path / "store"), tmp_path / "train.log"

    @dsl.pipeline
    def training(store: str) -> dict:
        return _train(store, "", str(log), {"max_error_retries": 1}, 3).output

    with pytest.raises(RuntimeError):
        training(store=store_url)

    # Try 1 fails, try 2 resumes from the step-9 snapshot and fails again; tries 3 and 4 see
    # two errors, more than max_error_retries=1, and never start the function.
    assert _starts(log) == [0, 10]
    with open_store(store_url) as store:
        keys = list(store.keys())
        assert len(keys) == 1
        outcomes = store.records.outcomes(keys[0])
    assert [o.outcome.value for o in outcomes] == ["failed", "failed"]
    assert all("a bug at step 12" in o.detail["error"] for o in outcomes)
