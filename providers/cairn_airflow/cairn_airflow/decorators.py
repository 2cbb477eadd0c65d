"""``@task.cairn``: a TaskFlow task whose callable receives a cairn Checkpointer.

::

    @task.cairn(every_steps=50, retries=3)
    def train(epochs: int, ckpt):
        import torch
        ...
        start = ckpt.restore(model=model, optimizer=opt)
        for step in range(start, total):
            ...
            ckpt.step(step)
        return {"loss": loss}

    train(epochs=3)            # ckpt is not an argument: Airflow never sees it

The parameter named ``ckpt`` (or annotated ``Checkpointer``) is removed from the signature
Airflow binds, partials and maps at parse time; at run time it receives a
:class:`cairn.state.Checkpointer` for the key ``(dag_id, task_id, run_id, map_index)``. Options
(``every_steps``, ``every_seconds``, ``keep_snapshots``, ``cairn_conn_id``, ``store_url``,
``checkpointer_options``) are those of :class:`~cairn_airflow.operators.CairnPythonOperator`;
every other keyword is an operator argument (``retries``, ``retry_delay``, ...).

``pod={...}`` runs the function in a Kubernetes pod instead, in state mode: the mapping holds
:class:`~cairn_airflow.kubernetes.CairnKubernetesPodOperator` arguments (``image``,
``sidecar_image``, ``namespace``, ...); see :mod:`cairn_airflow.kubernetes_decorator`::

    @task.cairn(pod={"image": "REPO/train:1.0", "sidecar_image": "REPO/cairn-sidecar:0.1.0",
                     "namespace": "training"}, every_steps=50, retries=3)
    def train(epochs: int, ckpt):
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.decorator import DecoratedOperator, task_decorator_factory

from cairn_airflow.operators import CairnPythonOperator, hide_checkpointer

if TYPE_CHECKING:
    from airflow.sdk.bases.decorator import TaskDecorator


class _CairnDecoratedOperator(DecoratedOperator, CairnPythonOperator):
    """The operator behind ``@task.cairn``."""

    custom_operator_name: str = "@task.cairn"

    def __init__(self, *, python_callable: Callable[..., Any], op_args: Any, op_kwargs: Any,
                 **kwargs: Any) -> None:
        super().__init__(
            kwargs_to_upstream={"python_callable": python_callable, "op_args": op_args,
                                "op_kwargs": op_kwargs},
            python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs, **kwargs)


def cairn_task(python_callable: Callable[..., Any] | None = None,
               multiple_outputs: bool | None = None, *, pod: Mapping[str, Any] | None = None,
               **kwargs: Any) -> TaskDecorator:
    """Wrap a function into a cairn task (``@task.cairn`` or ``@cairn_task``); with ``pod=``,
    one that runs in a Kubernetes pod. See the module docstring."""
    operator_class: type[Any] = _CairnDecoratedOperator
    if pod is not None and pod is not False:
        # Imported only here: it imports the cncf Kubernetes provider (never torch).
        from cairn_airflow.kubernetes_decorator import (
            _CairnKubernetesDecoratedOperator,
            pod_operator_kwargs,
        )

        kwargs = pod_operator_kwargs(pod, kwargs)
        operator_class = _CairnKubernetesDecoratedOperator
    if python_callable is not None:
        return task_decorator_factory(python_callable=hide_checkpointer(python_callable),
                                      multiple_outputs=multiple_outputs,
                                      decorated_operator_class=operator_class, **kwargs)
    factory = task_decorator_factory(multiple_outputs=multiple_outputs,
                                     decorated_operator_class=operator_class, **kwargs)

    def decorate(fn: Callable[..., Any]) -> Any:
        return factory(hide_checkpointer(fn))  # type: ignore[call-arg]

    return decorate  # type: ignore[return-value]
