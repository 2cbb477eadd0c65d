"""``@task.cairn(pod={...})``: the pod a try would submit, and the script that pod runs.

The pod is rendered as in ``test_kubernetes_operator.py``: the operator's real ``execute`` runs
(the cncf decorator writes the script, the arguments file and the command; the cairn operator
builds the pod through Airflow's ``pod_mutation_hook`` chain and validates it strict) up to
KubernetesPodOperator's ``execute``, which here returns the built pod instead of creating it on
a cluster (none is reachable: the kube config names an address nothing listens on).

The script is then run as the pod's main container would run it, taken from the rendered pod:
``__PYTHON_SCRIPT``/``__PYTHON_INPUT`` decoded to files and ``python SCRIPT INPUT OUTPUT`` with
the pod's ``CAIRN_*`` environment (its store is a local directory). Only two things differ from
the pod: the interpreter is this venv's (it has cairn and torch), and OUTPUT is a file in the
test's temporary directory instead of ``/airflow/xcom/return.json`` — the script takes that path
as an argument, so nothing in the script is rewritten.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes.client import ApiClient

from cairn.exceptions import ConfigError
from cairn.store import Key
from cairn import open_store
from cairn.store.outcomes import OutcomeKind
from cairn.store.slotlog import RecordKind
from cairn_airflow.kubernetes import CairnKubernetesPodOperator
from cairn_airflow.kubernetes_decorator import function_source
from cairn_airflow.task_keys import task_key

SIDECAR = "repo/cairn-sidecar:0.1.0"
RUN_ID = "manual__2026-11-29T00:00:00+00:00"


def pod_options(kubeconfig: str, store_url: str, **more: Any) -> dict[str, Any]:
    return {"image": "repo/train:1.0", "namespace": "training", "sidecar_image": SIDECAR,
            "store_url": store_url, "config_file": kubeconfig, "in_cluster": False, **more}


def training_dag(kubeconfig: str, store_url: str, **options: Any) -> Any:
    """A DAG with one pod task that trains a tiny torch model with ``ckpt``; the environment
    variable CAIRN_TEST_FAIL_AT makes a try fail after that step."""
    from airflow.sdk import DAG, task

    with DAG("pod_dag", schedule=None) as dag:
        @task.cairn(pod=pod_options(kubeconfig, store_url), every_steps=2, retries=2, **options)
        def train(steps: int, ckpt, lr: float = 0.1):
            import os

            import torch

            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            start = ckpt.restore(model=model, optimizer=opt)
            x, y = torch.ones(8, 4), torch.zeros(8, 1)
            fail_at = int(os.environ.get("CAIRN_TEST_FAIL_AT", "-1"))
            loss = None
            for step in range(start, steps):
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                ckpt.step(step)
                if step == fail_at:
                    raise RuntimeError(f"failing after step {step}")
            return {"start": start, "steps": steps, "loss": None if loss is None else float(loss)}

        train(6, lr=0.05)
    return dag


def context_for(op: Any, *, map_index: int = -1) -> dict[str, Any]:
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    ti = RuntimeTaskInstance.model_construct(
        id=uuid.uuid4(), task_id=op.task_id, dag_id=op.dag_id, run_id=RUN_ID, try_number=1,
        map_index=map_index, dag_version_id=uuid.uuid4(), task=op)
    return {"ti": ti, "task_instance": ti, "run_id": RUN_ID, "dag": op.dag}


def render(op: Any, context: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The pod the operator's ``execute`` would create, as a manifest."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    monkeypatch.setattr(KubernetesPodOperator, "execute",
                        lambda self, context: self.build_pod_request_obj(context))
    return ApiClient().sanitize_for_serialization(op.execute(context))


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec = doc["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"]
                if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env") or []}


def run_pod_script(base: dict[str, Any], workdir: Path, **env: str) -> tuple[int, Any, str]:
    """Run the main container's script as the pod would; returns (exit code, the return value
    file's JSON or None, stderr)."""
    pod_env = env_of(base)
    script, args = workdir / "script.py", workdir / "script.in"
    script.write_bytes(base64.b64decode(pod_env["__PYTHON_SCRIPT"]))
    args.write_bytes(base64.b64decode(pod_env["__PYTHON_INPUT"]))
    out = workdir / "return.json"
    out.unlink(missing_ok=True)
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               **{k: v for k, v in pod_env.items() if k.startswith("CAIRN_")}, **env}
    # The pod's notice file lives on the cairn volume; here there is no sidecar to write it.
    run_env.pop("CAIRN_NOTICE_FILE", None)
    done = subprocess.run([sys.executable, str(script), str(args), str(out)], env=run_env,
                          cwd=workdir, capture_output=True, text=True, timeout=300)
    text = out.read_text() if out.exists() else ""
    return done.returncode, json.loads(text) if text else None, done.stderr


def test_the_decorated_task_renders_a_valid_cairn_pod(kubeconfig: str, store_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    op = training_dag(kubeconfig, store_url).get_task("train")
    assert isinstance(op, CairnKubernetesPodOperator) and op.mode == "state"
    assert op.operator_name == "@task.cairn" and op.retries == 2
    context = context_for(op, map_index=3)
    doc = render(op, context, monkeypatch)

    sidecar = container(doc, "cairn-sidecar")
    assert sidecar["image"] == SIDECAR and sidecar["restartPolicy"] == "Always"
    base = container(doc, "base")
    env = env_of(base)
    key = task_key(context)
    assert key == Key(("pod_dag", "train", RUN_ID, "3"))
    assert env["CAIRN_STORE"] == store_url and env["CAIRN_KEY"] == str(key)
    assert {"name": "cairn-shared", "mountPath": "/var/run/cairn"} in base["volumeMounts"]
    # The main container runs the generated script (state mode: no `cairn run`), by exec.
    assert base["image"] == "repo/train:1.0"
    assert base["command"][:2] == ["bash", "-cx"]
    assert base["command"][2].endswith(
        " && exec python /tmp/script.py /tmp/script.in /airflow/xcom/return.json")
    script = base64.b64decode(env["__PYTHON_SCRIPT"]).decode()
    assert "def train(steps: int, ckpt, lr: float = 0.1):" in script
    assert "@task.cairn" not in script and "train = _cairn_pod_task(" in script
    assert container(doc, "airflow-xcom-sidecar")  # the return value goes to XCom
    kubernetes_validate.validate(doc, "1.29", strict=True)


def test_the_pod_script_trains_returns_and_marks_the_key_done(
        kubeconfig: str, store_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    op = training_dag(kubeconfig, store_url).get_task("train")
    context = context_for(op)
    base = container(render(op, context, monkeypatch), "base")

    code, result, stderr = run_pod_script(base, tmp_path)
    assert code == 0, stderr
    assert result["start"] == 0 and result["steps"] == 6 and result["loss"] > 0
    key = task_key(context)
    with open_store(store_url, create=False) as store:
        assert store.history(key)[-1].kind is RecordKind.DONE and store.snapshots(key) == []
        (outcome,) = store.records.outcomes(key)
        assert outcome.outcome is OutcomeKind.SUCCEEDED and outcome.progress.kept_step == 5


def test_a_failed_pod_try_resumes_and_keep_snapshots_keeps_them(
        kubeconfig: str, store_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    op = training_dag(kubeconfig, store_url, keep_snapshots=True).get_task("train")
    context = context_for(op)
    base = container(render(op, context, monkeypatch), "base")
    key = task_key(context)

    code, result, stderr = run_pod_script(base, tmp_path, CAIRN_TEST_FAIL_AT="4")
    assert code == 1 and result is None and "failing after step 4" in stderr
    code, result, stderr = run_pod_script(base, tmp_path)
    assert code == 0, stderr
    # every_steps=2: snapshots after steps 1 and 3 (and 5); the retry resumed after step 3.
    assert result["start"] == 4
    with open_store(store_url, create=False) as store:
        assert store.history(key)[-1].kind is RecordKind.SNAP
        assert [s.manifest.step for s in store.snapshots(key)][0] == 5
        assert [o.outcome for o in store.records.outcomes(key)] == [OutcomeKind.FAILED,
                                                            OutcomeKind.SUCCEEDED]


def read_failure() -> Any:
    """The main suite's injection of a reading-side library failure (by its path)."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "tests" / "support" / "read_failure.py"
    spec = importlib.util.spec_from_file_location("cairn_test_read_failure", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pod_script_whose_restore_fails_on_its_side_exits_8_and_skips_nothing(
        kubeconfig: str, store_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    op = training_dag(kubeconfig, store_url, keep_snapshots=True).get_task("train")
    context = context_for(op)
    base = container(render(op, context, monkeypatch), "base")
    key = task_key(context)
    code, _, stderr = run_pod_script(base, tmp_path, CAIRN_TEST_FAIL_AT="4")
    assert code == 1, stderr
    with open_store(store_url, create=False) as store:
        seqs = [s.seq for s in store.snapshots(key)]  # after steps 1 and 3

    helper = read_failure()
    code, result, stderr = run_pod_script(base, tmp_path,
                                          **helper.injecting_env(tmp_path / "inject"))
    assert code == 8 and result is None, stderr  # the operator maps 8 to AirflowFailException
    assert f"ValueError: {helper.INJECTED}" in stderr and "skipping snapshot" not in stderr
    with open_store(store_url, create=False) as store:
        assert [s.seq for s in store.snapshots(key)] == seqs and store.verify(key).ok
        assert [o.outcome for o in store.records.outcomes(key)] == [OutcomeKind.FAILED] * 2
    code, result, stderr = run_pod_script(base, tmp_path)
    assert code == 0 and result["start"] == 4, stderr


@pytest.mark.parametrize(("raise_", "expected"), [
    ("preempted-saved", 75), ("preempted-kept", 76), ("fenced", 5), ("nothing", 0)])
def test_the_pod_script_exits_with_cairn_runs_codes(raise_: str, expected: int, kubeconfig: str,
                                                    store_url: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk import DAG
    from cairn_airflow import cairn_task

    with DAG("codes_dag", schedule=None) as dag:
        @cairn_task(pod=pod_options(kubeconfig, store_url))
        def stop(what: str):  # no ckpt: the script imports neither torch nor the Checkpointer
            from cairn.exceptions import Fenced, Preempted

            errors = {"preempted-saved": Preempted("notice", seq=4),
                      "preempted-kept": Preempted("notice"), "fenced": Fenced("newer")}
            if what in errors:
                raise errors[what]
            return "ran"

        stop(raise_)
    op = dag.get_task("stop")
    code, result, stderr = run_pod_script(
        container(render(op, context_for(op), monkeypatch), "base"), tmp_path)
    assert code == expected, stderr
    assert result == ("ran" if expected == 0 else None)


def test_bad_pod_options_and_ckpt_arguments_are_refused(kubeconfig: str, store_url: str) -> None:
    from airflow.sdk import DAG, task

    def train(steps: int, ckpt):
        return steps

    good = pod_options(kubeconfig, store_url)
    with pytest.raises(ConfigError, match=r"pod=True: .*mapping.*\"image\""):
        task.cairn(pod=True)
    with pytest.raises(ConfigError, match=r"'imagepullpolicy' \(did you mean 'image_pull_policy'"):
        task.cairn(pod={**good, "imagepullpolicy": "Always"})
    with pytest.raises(ConfigError, match=r"\['retries'\].*pass them to @task.cairn itself"):
        task.cairn(pod={**good, "retries": 3})
    with pytest.raises(ConfigError, match="'mode'.*state mode"):
        task.cairn(pod={**good, "mode": "process"})
    with pytest.raises(ConfigError, match="'cmds'"):
        task.cairn(pod={**good, "cmds": ["python"]})
    with pytest.raises(ConfigError, match="needs an image"):
        task.cairn(pod={k: v for k, v in good.items() if k != "image"})
    with pytest.raises(ConfigError, match=r"needs \['sidecar_image'\]"):
        task.cairn(pod={k: v for k, v in good.items() if k != "sidecar_image"})
    with pytest.raises(ConfigError, match=r"\['store_url'\] given both"):
        task.cairn(pod=good, store_url=store_url)
    with DAG("bad_pod_dag", schedule=None):
        pod_train = task.cairn(pod=good)(train)
        with pytest.raises(ConfigError, match="op_kwargs must not set 'ckpt'"):
            pod_train(3, ckpt=None)
        with pytest.raises(TypeError, match="ckpt"):
            pod_train.expand(ckpt=[1, 2])
        with pytest.raises(ConfigError, match="every_steps"):
            task.cairn(pod=good, every_steps=0)(train)(3)
        with pytest.raises(ConfigError, match="checkpointer_options must not set"):
            task.cairn(pod=good, checkpointer_options={"key": "x"})(train)(3)
        pod_train.expand(steps=[1, 2])  # mapping over the real arguments works
        task.cairn(pod=False)(train)(3)  # pod=False: the local task


def test_the_script_source_drops_only_the_cairn_decorator() -> None:
    import functools
    from types import SimpleNamespace

    task = SimpleNamespace(cairn=lambda **kwargs: lambda fn: fn)  # only its source text counts

    def keep(fn):
        return functools.wraps(fn)(lambda *a, **k: fn(*a, **k))

    @task.cairn(
        pod={"image": "x"},  # a multi-line decorator call
    )
    @keep
    def f(ckpt):
        return 1

    source = function_source(f)
    assert source.startswith("@keep\ndef f(ckpt):\n") and "task.cairn" not in source


def test_a_dag_with_a_pod_task_parses_without_torch() -> None:
    """The dag-processor parses pod tasks without torch or CRIU (the in-pod code is source)."""
    code = (
        "import sys\n"
        "from airflow.sdk import DAG, task\n"
        "with DAG('parse_dag', schedule=None):\n"
        "    @task.cairn(pod={'image': 'r/i:1', 'sidecar_image': 'r/s:1', 'store_url': '/s'})\n"
        "    def train(n: int, ckpt):\n"
        "        return n\n"
        "    train.expand(n=[1, 2])\n"
        "heavy = {'torch', 'numpy', 'cairn.state.checkpointer', 'cairn.process',\n"
        "         'cairn.process.criu'}\n"
        "assert 'cairn_airflow.kubernetes_decorator' in sys.modules\n"
        "print(sorted(heavy & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
