"""``run_command``: container components cannot run under kfp.local, so this runs the
launcher they carry as a real process (dry run: it prints the ``cairn run`` command line
instead of exec'ing it) and checks the compiled spec."""

# No `from __future__ import annotations`: kfp reads the pipeline's annotations as objects.
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kfp import compiler, dsl

import cairn_kfp
from cairn.cli.main import build_parser
from cairn.exceptions import ConfigError
from cairn.store import Key, Store
from cairn import open_store
from cairn.store.outcomes import Outcome, OutcomeKind
from cairn_kfp.container import LAUNCHER


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CAIRN_STORE"}
    environ.update({"CAIRN_KFP_DRY_RUN": "1", **(env or {})})
    return subprocess.run([sys.executable, "-c", LAUNCHER, *args], capture_output=True,
                          text=True, env=environ, timeout=60)


def test_launcher_builds_the_cairn_run_command_line(tmp_path: Path) -> None:
    store = str(tmp_path / "store")  # none yet: the first try has no history
    done = launch(store, "job-1", "finetune", "a/b", "", "", "10m", "30s",
                  "--", "python", "train.py", "--epochs", "3")
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    assert argv == ["cairn", "run", "--store", store, "--key", "job-1/finetune/a%2Fb",
                    "--every", "10m", "--grace", "30s", "--",
                    "python", "train.py", "--epochs", "3"]
    assert "resume plan: starting fresh" in done.stderr
    # KFP gives a step no try number: a store without any try of the key is said to be
    # either a first try or a retry that does not see its store (issue 34).
    assert f"the store {store} holds no try of job-1/finetune/a%2Fb: a first try, or a " \
        "retry that does not see the store" in done.stderr
    # Nor does KFP keep anything across tries: every try says that a rollback goes unnoticed.
    assert done.stderr.count("Kubeflow Pipelines keeps nothing from one try of a step to the "
                             "next") == 1 and "CAIRN_COMMITTED_DIR" in done.stderr
    args = build_parser().parse_args(argv[1:])  # what cairn's own CLI makes of it
    assert args.run_store == store and args.key == "job-1/finetune/a%2Fb"
    assert args.cmd[-4:] == ["python", "train.py", "--epochs", "3"]


def test_launcher_takes_the_store_from_the_environment_and_honours_key_and_prefix(
        tmp_path: Path) -> None:
    store = str(tmp_path / "cairn-store")
    done = launch("", "job-1", "finetune", "", "", "exp-7", "5m", "10s", "--", "true",
                  env={"CAIRN_STORE": store})
    argv = json.loads(done.stdout)
    assert argv[2:6] == ["--store", store, "--key", "exp-7/finetune"]
    done = launch(store, "job-1", "finetune", "", "shared/key", "", "5m", "10s", "--", "true")
    assert json.loads(done.stdout)[5] == "shared/key"


def _failed_try(store: Store, key: Key, *, snapshot: bool) -> int | None:
    """A real try of ``key`` that committed a snapshot (or not) and failed on its own."""
    attempt = store.open_attempt(key)
    seq = None
    if snapshot:
        with attempt.snapshot() as snap:
            snap.add_bytes("state.bin", b"x" * 4096)
            seq = snap.commit(step=9).seq
    store.records.record_outcome(key, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.FAILED,
                                      started_at=1.0, ended_at=2.0))
    return seq


def test_launcher_plans_each_try_with_the_resume_policy(tmp_path: Path) -> None:
    """resume_on=preemption: after the step's own error the next try must not restore that
    try's snapshot (--exclude-seqs); past max_error_retries no try starts at all."""
    url, key = str(tmp_path / "store"), Key(("job-1", "finetune"))
    with open_store(url) as store:
        seq = _failed_try(store, key, snapshot=True)
    policy = json.dumps({"resume_on": "preemption", "max_error_retries": 1, "loop_guard": True})
    done = launch(url, "job-1", "finetune", "", "", "", "5m", "10s", policy, "--", "true")
    assert done.returncode == 0, done.stderr
    assert "holds no try of" not in done.stderr, "the store knows an earlier try"
    argv = json.loads(done.stdout)
    assert argv[argv.index("--exclude-seqs") + 1] == str(seq)
    assert build_parser().parse_args(argv[1:]).exclude_seqs == str(seq)

    with open_store(url) as store:
        _failed_try(store, key, snapshot=False)
    done = launch(url, "job-1", "finetune", "", "", "", "5m", "10s", policy, "--", "true")
    assert done.returncode != 0 and "max_error_retries=1" in done.stderr
    assert done.stdout == ""  # no cairn run command line: the command never starts


def test_run_command_passes_a_non_default_policy_and_checks_it(tmp_path: Path) -> None:
    step = cairn_kfp.run_command(["true"], name="job", max_error_retries=2)

    @dsl.pipeline
    def p(store: str = "/s") -> None:
        cairn_kfp.call(step, cairn_store=store)

    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(p, str(path))
    [executor] = yaml.safe_load(path.read_text())["deploymentSpec"]["executors"].values()
    assert json.loads(executor["container"]["args"][8]) == {
        "loop_guard": True, "max_error_retries": 2, "resume_on": "any_failure"}
    with pytest.raises(ConfigError, match="resume_on must be one of"):
        cairn_kfp.run_command(["true"], resume_on="always")


def test_launcher_refuses_unresolved_placeholders_and_a_missing_store() -> None:
    done = launch("/s", "{{$.pipeline_job_uuid}}", "t", "", "", "", "10m", "30s", "--", "true")
    assert done.returncode != 0 and "never resolved" in done.stderr
    done = launch("", "job", "t", "", "", "", "10m", "30s", "--", "true")
    assert done.returncode != 0 and "CAIRN_STORE" in done.stderr
    done = launch("/s", "job", "t")
    assert done.returncode != 0 and "expected STORE" in done.stderr


def test_compiled_spec_runs_the_launcher_with_whole_placeholders(tmp_path: Path) -> None:
    step = cairn_kfp.run_command(["python", "train.py"], name="finetune", image="img:1",
                                 every="2m")

    @dsl.pipeline
    def p(store: str = "/s") -> None:
        cairn_kfp.call(step, cairn_store=store)

    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(p, str(path))
    spec = yaml.safe_load(path.read_text())
    [executor] = spec["deploymentSpec"]["executors"].values()
    container = executor["container"]
    assert container["image"] == "img:1"
    assert container["command"] == ["python3", "-c", LAUNCHER]
    assert container["args"][6:] == ["2m", "30s", "--", "python", "train.py"]
    assert container["args"][1] == "{{$.inputs.parameters['cairn_run_id']}}"
    params = spec["root"]["dag"]["tasks"]["finetune"]["inputs"]["parameters"]
    assert params["cairn_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert params["cairn_task_name"]["runtimeValue"]["constant"] == "{{$.pipeline_task_name}}"
    assert "{{$." not in LAUNCHER  # the program itself holds no placeholder text


def test_call_fills_a_string_loop_item_and_refuses_others(tmp_path: Path) -> None:
    step = cairn_kfp.run_command(["true"], name="job")

    @dsl.pipeline
    def p() -> None:
        with dsl.ParallelFor(["a", "b"]):
            cairn_kfp.call(step, cairn_store="/s")

    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(p, str(path))
    spec = yaml.safe_load(path.read_text())
    [loop] = spec["root"]["dag"]["tasks"].values()
    task = spec["components"][loop["componentRef"]["name"]]["dag"]["tasks"]["job"]
    assert "componentInputParameter" in task["inputs"]["parameters"]["cairn_loop_item"]

    with pytest.raises(ConfigError, match="cairn_loop_item="):
        @dsl.pipeline
        def q() -> None:
            with dsl.ParallelFor([1, 2]):
                cairn_kfp.call(step, cairn_store="/s")


def test_run_command_refuses_an_empty_command() -> None:
    with pytest.raises(ConfigError, match="non-empty list"):
        cairn_kfp.run_command([])
