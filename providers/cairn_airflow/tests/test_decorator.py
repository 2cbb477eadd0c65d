"""``@task.cairn`` at parse time: the Checkpointer parameter is hidden from Airflow."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from airflow.sdk import DAG, task

from cairn.exceptions import ConfigError
from cairn_airflow import cairn_task
from cairn_airflow.operators import CairnPythonOperator, checkpointer_parameter, hide_checkpointer, task_key


def test_ckpt_parameter_by_name_or_annotation() -> None:
    def by_name(x, ckpt): ...
    def by_string(x, state: "Checkpointer"): ...  # noqa: F821 - never resolved
    def by_dotted(x, state: "cairn.state.Checkpointer | None" = None): ...  # noqa: F821
    def none(x, **kwargs): ...
    def two(ckpt, other: "Checkpointer"): ...  # noqa: F821
    def positional_only(ckpt, /): ...

    assert checkpointer_parameter(by_name) == "ckpt"
    assert checkpointer_parameter(by_string) == "state"
    assert checkpointer_parameter(by_dotted) == "state"
    assert checkpointer_parameter(none) is None
    with pytest.raises(ConfigError, match="keep one"):
        checkpointer_parameter(two)
    with pytest.raises(ConfigError, match="positional-only"):
        checkpointer_parameter(positional_only)


def test_hidden_signature_passes_calls_through() -> None:
    def f(a, ckpt, b=2):
        return a, ckpt, b

    g = hide_checkpointer(f)
    assert list(inspect.signature(g).parameters) == ["a", "b"]
    assert g(1, ckpt="C", b=3) == (1, "C", 3)
    assert checkpointer_parameter(g) == "ckpt"
    assert hide_checkpointer(g) is g
    assert g.__name__ == "f" and inspect.getsource(g).lstrip().startswith("def f(")


def test_task_cairn_binds_and_maps_without_ckpt() -> None:
    with DAG("cairn_parse", schedule=None) as dag:
        @task.cairn(every_steps=5, retries=2)
        def train(lr: float, ckpt, epochs: int = 1):
            return lr

        train(0.1)
        train.expand(lr=[0.1, 0.2])
        with pytest.raises(TypeError):
            train()  # lr is still required
        with pytest.raises(TypeError, match="ckpt"):
            train(0.1, ckpt=None)
        with pytest.raises(TypeError, match="ckpt"):
            train.expand(ckpt=[1, 2])

    op = dag.get_task("train")
    assert isinstance(op, CairnPythonOperator)
    assert op.ckpt_parameter == "ckpt" and op.every_steps == 5 and op.retries == 2
    assert op.get_python_source().lstrip().startswith("def train(")
    assert dag.get_task("train__1").operator_name == "@task.cairn"


def test_cairn_task_is_the_decorator_and_checks_options() -> None:
    with DAG("cairn_options", schedule=None):
        @cairn_task
        def plain():
            return 1

        plain()
        def uses(ckpt):
            return None

        with pytest.raises(ConfigError, match="every_steps"):
            cairn_task(every_steps=0)(uses)()
        with pytest.raises(ConfigError, match="checkpointer_options"):
            cairn_task(checkpointer_options={"key": "x"})(uses)()


def test_key_is_the_task_instance_never_the_try() -> None:
    ti = SimpleNamespace(dag_id="d", task_id="g.t", run_id="manual__2026-01-01T00:00:00+00:00",
                         map_index=-1, try_number=3)
    key = task_key({"ti": ti})
    assert key.components == ("d", "g.t", "manual__2026-01-01T00:00:00+00:00", "-1")
    assert task_key({"ti": SimpleNamespace(**{**vars(ti), "map_index": 4, "try_number": 1})}
                    ).components[-1] == "4"


def test_classic_operator_finds_the_checkpointer_parameter() -> None:
    def work(n, ckpt):
        return n

    with DAG("cairn_classic", schedule=None):
        op = CairnPythonOperator(task_id="work", python_callable=work, op_kwargs={"n": 1},
                                 every_seconds=30, keep_snapshots=True)
        assert op.ckpt_parameter == "ckpt" and op.keep_snapshots and op.every_seconds == 30
        with pytest.raises(ConfigError, match="op_kwargs must not set 'ckpt'"):
            CairnPythonOperator(task_id="bad", python_callable=work, op_kwargs={"ckpt": 1})
