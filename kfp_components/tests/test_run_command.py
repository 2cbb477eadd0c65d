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
from cairn_kfp.container import LAUNCHER


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CAIRN_STORE"}
    environ.update({"CAIRN_KFP_DRY_RUN": "1", **(env or {})})
    return subprocess.run([sys.executable, "-c", LAUNCHER, *args], capture_output=True,
                          text=True, env=environ, timeout=60)


def test_launcher_builds_the_cairn_run_command_line() -> None:
    done = launch("gs://b/cairn", "job-1", "finetune", "a/b", "", "", "10m", "30s",
                  "--", "python", "train.py", "--epochs", "3")
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    assert argv == ["cairn", "run", "--store", "gs://b/cairn", "--key", "job-1/finetune/a%2Fb",
                    "--every", "10m", "--grace", "30s", "--",
                    "python", "train.py", "--epochs", "3"]
    args = build_parser().parse_args(argv[1:])  # what cairn's own CLI makes of it
    assert args.run_store == "gs://b/cairn" and args.key == "job-1/finetune/a%2Fb"
    assert args.cmd[-4:] == ["python", "train.py", "--epochs", "3"]


def test_launcher_takes_the_store_from_the_environment_and_honours_key_and_prefix() -> None:
    done = launch("", "job-1", "finetune", "", "", "exp-7", "5m", "10s", "--", "true",
                  env={"CAIRN_STORE": "/mnt/cairn-store"})
    argv = json.loads(done.stdout)
    assert argv[2:6] == ["--store", "/mnt/cairn-store", "--key", "exp-7/finetune"]
    done = launch("/s", "job-1", "finetune", "", "shared/key", "", "5m", "10s", "--", "true")
    assert json.loads(done.stdout)[5] == "shared/key"


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
