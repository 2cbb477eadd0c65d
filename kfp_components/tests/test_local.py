"""Real kfp.local runs (SubprocessRunner, this interpreter): retries that resume.

Each task is a real process that imports torch and cairn; killed with SIGKILL on its first
attempt, it is retried by kfp.local's own retry policy (``set_retry``).
"""

# No `from __future__ import annotations`: kfp reads a plain component's annotations as objects.

import json
from pathlib import Path

import pytest
from kfp import dsl
from kfp.dsl import Dataset, Output

import cairn_kfp
from cairn import open_store  # with the secret CAIRN_SECRET_FILE names, as the tasks open it
from cairn.store import Key, write_secret_file
from cairn.store.slotlog import RecordKind
from cairn_kfp.kubernetes import set_retries

import kfp_workloads

pytestmark = pytest.mark.slow

EVERY, KILL_AT, STEPS = 5, 12, 16


def test_killed_training_resumes_from_its_snapshot(local_kfp: Path, tmp_path: Path) -> None:
    store_url = str(tmp_path / "store")
    marker, log = tmp_path / "killed", tmp_path / "train.log"

    @dsl.pipeline
    def training(store: str) -> dict:
        task = cairn_kfp.train(
            entrypoint="kfp_workloads:fit",
            arguments={"steps": STEPS, "kill_at": KILL_AT, "marker": str(marker),
                       "log": str(log)},
            cairn_store=store, cairn_options={"every_steps": EVERY, "persist": "inline"})
        set_retries(task, 1, backoff="0s")
        return task.output

    out = training(store=store_url).output

    assert marker.exists()  # the first attempt was killed
    lines = log.read_text().split()
    starts = [int(n) for word, n in zip(lines[::2], lines[1::2]) if word == "start"]
    # The last snapshot before the kill holds step 9 (every 5 steps, inline: durable at once).
    assert starts == [0, 10]
    assert KILL_AT + 1 - starts[1] < EVERY  # work redone: less than one snapshot interval
    assert out["resumed_step"] == 9
    assert out["result"]["start"] == 10
    expected = kfp_workloads.reference(STEPS)
    assert out["result"]["weight"] == expected["weight"]  # bit-identical to an unbroken run
    assert out["result"]["bias"] == expected["bias"]

    with open_store(store_url) as store:
        key = Key.parse(out["key"])
        history = store.history(key)
    assert key.components[1] == "train"  # (job id, task name): never the per-try task id
    opens = [r for r in history if r.kind is RecordKind.OPEN]
    assert len(opens) == 2
    assert opens[0].body["note"]["resumed_from"] is None
    assert opens[1].body["note"]["resumed_from"] is not None
    assert history[-1].kind is RecordKind.DONE


@dsl.component(base_image="python:3.11")
def make_inputs(count: int, data: Output[Dataset]) -> None:
    import os

    os.makedirs(data.path, exist_ok=True)
    for i in range(count):
        with open(os.path.join(data.path, f"part-{i:03d}.txt"), "w") as f:
            f.write(f"record {i}\n")


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_batch_inference_writes_each_output_exactly_once(
        local_kfp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encrypted: bool) -> None:
    store_url = str(tmp_path / "store")
    work = tmp_path / "work"
    work.mkdir()
    if encrypted:  # the tasks inherit the secret's setting, as a pod's containers would
        write_secret_file(str(tmp_path / "cairn.secret"))
        monkeypatch.setenv("CAIRN_SECRET_FILE", str(tmp_path / "cairn.secret"))
    monkeypatch.setenv("CAIRN_KFP_TEST_DIR", str(work))
    # Killed after predicting part-005, before committing it; the cursor snapshot (every 2
    # inputs) holds 4, so the retry redoes part-004 (already committed) and part-005.
    monkeypatch.setenv("CAIRN_KFP_TEST_KILL_AT", "part-005.txt")

    @dsl.pipeline
    def inference(store: str) -> dict:
        data = make_inputs(count=8)
        task = cairn_kfp.batch_inference(
            predictor="kfp_workloads:shout", inputs=data.outputs["data"], cairn_store=store,
            cairn_options={"every_steps": 2, "persist": "inline"})
        set_retries(task, 1, backoff="0s")
        return task.outputs["Output"]

    out = inference(store=store_url).output

    assert (work / "killed").exists()
    calls = (work / "calls").read_text().split()
    assert calls.count("part-004.txt") == 2 and calls.count("part-005.txt") == 2
    assert out == {"inputs": 8, "written": 3, "reused": 1, "resumed_at": 4}
    [results] = local_kfp.glob("*/batch-inference/results")
    index = json.loads((results / "index.json").read_text())
    with open_store(store_url) as store:
        assert store.encrypted == encrypted
        names = [info.name for info in store.backend.list("outputs/")]
        assert names == index["outputs"]
        assert len(names) == 8  # one object per input: each committed exactly once
        for i, name in enumerate(names):
            expected = f"RECORD {i}\n".encode()
            assert store.backend.read(name) == expected
            assert (results / f"part-{i:03d}.txt").read_bytes() == expected
            # In an encrypted store the output object holds no plaintext.
            assert (b"RECORD" in store.raw_backend.read(name)) == (not encrypted)
    assert not list(results.glob("*.partial"))


def test_placeholders_resolve_to_a_stable_key_per_task_and_loop_item(
        local_kfp: Path, tmp_path: Path) -> None:
    store_url = str(tmp_path / "store")

    @cairn_kfp.component(base_image="python:3.11")
    def whoami(tag: str) -> str:
        import os

        return os.environ["CAIRN_KEY"] + "|" + tag

    @dsl.component(base_image="python:3.11")
    def gather(keys: list, single: str) -> list:
        return sorted(keys) + [single]

    @dsl.pipeline
    def keys(store: str) -> list:
        with dsl.ParallelFor([3, 7]):
            looped = whoami(tag="loop", cairn_store=store)
        single = whoami(tag="one", cairn_store=store, cairn_checkpoint_prefix="exp-1")
        return gather(keys=dsl.Collected(looped.output), single=single.output).output

    out = keys(store=store_url).output
    *looped, single = out
    run_ids = {text.split("/")[0] for text in looped}
    assert len(run_ids) == 1 and "{{" not in run_ids.pop()
    assert [text.split("/", 1)[1] for text in looped] == ["whoami/3|loop", "whoami/7|loop"]
    assert single == "exp-1/whoami-2|one"


@dsl.component(base_image="python:3.11")
def identity(job: str, task: str, task_id: str, log: str) -> None:
    import os
    import signal

    first = not os.path.exists(log)
    with open(log, "a") as f:
        f.write(f"{job} {task} {task_id}\n")
    if first:
        os.kill(os.getpid(), signal.SIGKILL)


def test_job_id_and_task_name_are_stable_across_retries_the_task_id_is_not(
        local_kfp: Path, tmp_path: Path) -> None:
    """The reason the key never uses the task id (checked, since kfp could change it)."""
    log = tmp_path / "ids"

    @dsl.pipeline
    def ids(log: str) -> None:
        task = identity(job=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                        task=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
                        task_id=dsl.PIPELINE_TASK_ID_PLACEHOLDER, log=log)
        set_retries(task, 1, backoff="0s")

    ids(log=str(log))
    first, second = (line.split() for line in log.read_text().splitlines())
    assert first[:2] == second[:2] and first[1] == "identity"
    assert first[2] != second[2]
