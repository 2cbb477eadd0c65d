"""``CairnPythonOperator``: a PythonOperator whose callable gets a cairn Checkpointer.

Contract of one try (``execute``):

- the key is ``(dag_id, task_id, run_id, map_index)`` of the task instance (``map_index`` is
  ``-1`` for an unmapped task), never the try number, so every try of a task instance resumes
  the same work;
- the store comes from ``store_url=``, else from the connection ``cairn_conn_id``
  (``cairn_default``; see :mod:`cairn_airflow.hooks`, which falls back to
  ``$AIRFLOW_HOME/cairn-store`` when ``cairn_default`` does not exist);
- ``CAIRN_STORE``, ``CAIRN_KEY`` (and ``CAIRN_EVERY_STEPS``/``CAIRN_EVERY_SECONDS`` when set)
  are in ``os.environ`` while the callable runs, so a subprocess can use
  ``Checkpointer.from_env()``; the previous environment is restored afterwards;
- the callable's parameter named ``ckpt`` (or annotated ``Checkpointer``) receives a
  :class:`cairn.state.Checkpointer`; torch is imported only then, at run time;
- on success the key is marked done and its snapshots dropped (``keep_snapshots=True``
  keeps them); the Checkpointer is always closed;
- the XCom ``return_value`` is what the callable returned; the XCom ``cairn`` holds the
  snapshot metadata (key, store, seq, step, resumed_from, resumed_step, try_number, done),
  pushed on failure too;
- a step suspended on request (``Suspended``: ``cairn suspend`` or the snapshots page) defers
  the task with a resume trigger instead of failing (no retry used; see
  :mod:`cairn_airflow.suspend`, ``resume_after`` and ``resume_poll``); once resumed, the step
  runs again on a worker and continues from the suspend snapshot;
- a ``restore()`` that fails on the worker's side (:class:`cairn.exceptions.RestoreFailed`: a
  library error, a bug, out of memory; no snapshot was skipped) fails the task with
  ``AirflowFailException``, spending no retry on it, as does a try refused because the store
  offers only snapshots older than one a try of the task committed (deleted behind its back;
  the seq is kept in Airflow's task state store, :mod:`cairn_airflow.committed`;
  ``checkpointer_options={"allow_rollback": True}`` or ``CAIRN_ALLOW_ROLLBACK=1`` on the
  worker allows it);
- ``Preempted`` (and every other error) propagates, so the task fails and Airflow retries it;
  the retry resumes from the last committed snapshot, as the resume policy allows
  (``resume_on``, ``max_error_retries``, ``loop_guard``, ``max_preemptions``; see
  :mod:`cairn_airflow.resume`): before the callable runs, the key's history decides which
  snapshots this try must not restore (passed on as ``CAIRN_EXCLUDE_SEQS`` too) or that it
  must not run; after an error it may stop the retries or reschedule a preemption.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.python import PythonOperator

from cairn.exceptions import ConfigError
from cairn_airflow.committed import kept_by_airflow
from cairn_airflow.hooks import (
    DEFAULT_CONN_ID,
    SerializesCairnConnection,
    StoreConfig,
    operator_store_config,
    scoped_environ,
)
from cairn_airflow.resume import (
    begin_try,
    is_control_flow,
    raise_verdict,
    resume_policy,
    with_resume_params,
)
from cairn_airflow.suspend import SuspendDeferral, optional_seconds
from cairn_airflow.task_keys import task_key

log = logging.getLogger(__name__)

CKPT_PARAMETER = "ckpt"
XCOM_KEY = "cairn"
_HIDDEN_ATTR = "_cairn_ckpt_parameter"


def _names_checkpointer(annotation: Any) -> bool:
    """Whether a parameter annotation names cairn's Checkpointer (without importing it)."""
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        parts = re.split(r"[|\[\],]", annotation.strip().strip("'\""))
        return any(part.strip().rsplit(".", 1)[-1] == "Checkpointer" for part in parts)
    if getattr(annotation, "__name__", None) == "Checkpointer":
        return str(getattr(annotation, "__module__", "")).startswith("cairn")
    return any(_names_checkpointer(a) for a in getattr(annotation, "__args__", ()) or ())


def checkpointer_parameter(fn: Callable[..., Any]) -> str | None:
    """The name of ``fn``'s parameter that receives the Checkpointer: one named ``ckpt`` or
    annotated ``Checkpointer``; None if it has none. Raises ConfigError if two qualify or the
    parameter cannot be passed by keyword."""
    hidden = getattr(fn, _HIDDEN_ATTR, None)
    if hidden is not None:
        return hidden
    found = [p for p in inspect.signature(fn).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
             and (p.name == CKPT_PARAMETER or _names_checkpointer(p.annotation))]
    if not found:
        return None
    if len(found) > 1:
        raise ConfigError(f"{fn.__name__}: parameters {[p.name for p in found]} all ask for the "
                          "cairn Checkpointer; keep one")
    if found[0].kind is inspect.Parameter.POSITIONAL_ONLY:
        raise ConfigError(f"{fn.__name__}: the Checkpointer parameter {found[0].name!r} is "
                          "positional-only; cairn passes it by keyword")
    return found[0].name


def hide_checkpointer(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its Checkpointer parameter removed from the signature Airflow binds and maps
    at parse time; calling it passes everything through (the operator adds the Checkpointer)."""
    name = checkpointer_parameter(fn)
    if name is None or getattr(fn, _HIDDEN_ATTR, None) is not None:
        return fn
    import functools

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    call.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if p.name != name])
    setattr(call, _HIDDEN_ATTR, name)
    return call


def checkpointer_options_with(*, every_steps: int | None, every_seconds: float | None,
                              options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The Checkpointer's keyword arguments besides the store, key and excluded snapshots
    (which cairn sets): ``options`` plus the snapshot interval. Raises ConfigError naming the
    fix for a bad interval or an option cairn sets itself."""
    if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
        raise ConfigError("every_steps must be an integer of at least 1")
    if every_seconds is not None and every_seconds <= 0:
        raise ConfigError("every_seconds must be positive")
    merged = dict(options or {})
    clash = {"store", "key", "every_steps", "every_seconds", "exclude_seqs"} & set(merged)
    if clash:
        raise ConfigError(f"checkpointer_options must not set {sorted(clash)}: cairn sets the "
                          "store, the key and the excluded snapshots; use every_steps/"
                          "every_seconds")
    if every_steps is not None:
        merged["every_steps"] = every_steps
    if every_seconds is not None:
        merged["every_seconds"] = every_seconds
    return merged


class CairnPythonOperator(SuspendDeferral, SerializesCairnConnection, PythonOperator):
    """Runs ``python_callable`` with a cairn Checkpointer for this task instance's key (see the
    module docstring for the contract of one try).

    :param every_steps: snapshot every this many steps (``Checkpointer(every_steps=)``).
    :param every_seconds: snapshot at most this many seconds apart.
    :param keep_snapshots: on success, keep the snapshots instead of marking the key done.
    :param cairn_conn_id: the ``cairn`` connection naming the store.
    :param store_url: the store, overriding the connection.
    :param checkpointer_options: more keyword arguments for ``Checkpointer`` (``preemption=``,
        ``persist=``, ``when_busy=``, ...).
    (The resume options: :data:`cairn_airflow.resume.RESUME_PARAMS_DOC`.)
    """

    ui_color = "#d8c8a8"

    def __init__(self, *, python_callable: Callable[..., Any], every_steps: int | None = None,
                 every_seconds: float | None = None, keep_snapshots: bool = False,
                 cairn_conn_id: str = DEFAULT_CONN_ID, store_url: str | None = None,
                 checkpointer_options: Mapping[str, Any] | None = None,
                 resume_on: str = "any_failure", max_error_retries: int | None = None,
                 loop_guard: bool = True, max_preemptions: int = 0,
                 resume_after: timedelta | float | str | None = None,
                 resume_poll: timedelta | float | str | None = None, **kwargs: Any) -> None:
        super().__init__(python_callable=python_callable, **kwargs)
        self.resume_after = optional_seconds(resume_after, "resume_after")
        self.resume_poll = optional_seconds(resume_poll, "resume_poll")
        self.resume_policy = resume_policy(resume_on=resume_on,
                                           max_error_retries=max_error_retries,
                                           loop_guard=loop_guard, max_preemptions=max_preemptions)
        options = checkpointer_options_with(every_steps=every_steps, every_seconds=every_seconds,
                                            options=checkpointer_options)
        self.ckpt_parameter = checkpointer_parameter(python_callable)
        if self.ckpt_parameter is not None and self.ckpt_parameter in (self.op_kwargs or {}):
            raise ConfigError(f"op_kwargs must not set {self.ckpt_parameter!r}: cairn passes the "
                              "Checkpointer there")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep_snapshots = keep_snapshots
        self.cairn_conn_id = cairn_conn_id
        self.store_url = store_url
        self.checkpointer_options = dict(checkpointer_options or {})
        self._checkpointer_kwargs = options
        self._cairn_ckpt: Any = None

    def store_config(self) -> StoreConfig:
        return operator_store_config(store_url=self.store_url, cairn_conn_id=self.cairn_conn_id)

    def execute(self, context: Any) -> Any:
        from cairn.exceptions import Suspended

        config = self.store_config()
        try:
            return self._execute_try(context, config)
        except Suspended:
            self.defer_suspended(context, store_url=config.url, key=task_key(context),
                                 env=config.env)
            return self._execute_try(context, config)  # discarded meanwhile: start afresh

    def _execute_try(self, context: Any, config: StoreConfig) -> Any:
        from cairn.exceptions import Suspended

        key = task_key(context)
        log.info("cairn: key %s in %s (%s)", key, config.url, config.source)
        this_try = begin_try(config.url, key, self.resume_policy, env=config.env,
                             try_number=getattr(context["ti"], "try_number", None))
        env = {**this_try.env(every_steps=self.every_steps, every_seconds=self.every_seconds),
               **config.env}
        with scoped_environ(env), kept_by_airflow(context, config.url, key):
            ckpt = self._cairn_ckpt = (this_try.checkpointer(**self._checkpointer_kwargs)
                                       if self.ckpt_parameter is not None else None)
            try:
                result = super().execute(context)
            except BaseException as error:
                self._close_after(ckpt, error)
                # A skip or a deferral is not how the step ended, nor an error of it. The
                # outcome goes to the store before anything talks to Airflow's API server:
                # in a metadata-database outage that call waits until the task is killed.
                control = is_control_flow(error)
                verdict = None if control else this_try.ended(error=error, ckpt=ckpt)
                self._push_metadata(context, ckpt, config.url, key, done=False,
                                    plan_reason=this_try.reason)
                if verdict is None:
                    raise
                if isinstance(error, Exception) and not isinstance(error, Suspended):
                    raise_verdict(this_try, verdict, error, delay=self.retry_delay)
                raise
            finally:
                self._cairn_ckpt = None
            try:
                if not self.keep_snapshots:
                    this_try.finish(ckpt)
            except BaseException as error:
                self._close_after(ckpt, error)
                this_try.ended(error=error, ckpt=ckpt)
                raise
            if ckpt is not None:
                ckpt.close()  # raises if the last snapshot was not committed
            this_try.ended(error=None, ckpt=ckpt)  # before the API call (see above)
            self._push_metadata(context, ckpt, config.url, key, done=not self.keep_snapshots,
                                plan_reason=this_try.reason)
        return result

    def execute_callable(self) -> Any:
        if self.ckpt_parameter is not None:
            self.op_kwargs = {**self.op_kwargs, self.ckpt_parameter: self._cairn_ckpt}
        return super().execute_callable()

    @staticmethod
    def _close_after(ckpt: Any, error: BaseException) -> None:
        if ckpt is None:
            return
        from cairn.exceptions import Preempted

        if isinstance(error, Preempted):
            log.warning("cairn: preempted (%s); the retry resumes from the last committed "
                        "snapshot", error)
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - the callable's error is the one to raise
            log.error("cairn: closing the Checkpointer after %s failed: %s",
                      type(error).__name__, e)

    def _push_metadata(self, context: Any, ckpt: Any, url: str, key: Any, *, done: bool,
                       plan_reason: str) -> None:
        meta = snapshot_metadata(ckpt, url, key, done=done)
        meta["resume_plan"] = plan_reason
        ti = context["ti"]
        meta["try_number"] = getattr(ti, "try_number", None)
        try:
            ti.xcom_push(key=XCOM_KEY, value=meta)
        except Exception as e:  # noqa: BLE001 - metadata must never fail the task
            log.warning("cairn: could not push the %r XCom: %s", XCOM_KEY, e)


def snapshot_metadata(ckpt: Any, url: str, key: Any, *, done: bool) -> dict[str, Any]:
    """The ``cairn`` XCom: what this try committed and what it resumed from."""
    meta: dict[str, Any] = {"key": str(key), "store": url, "seq": None, "step": None,
                            "resumed_from": None, "resumed_step": None, "done": done}
    if ckpt is not None:
        restored = getattr(ckpt, "restored_from", None)
        meta.update(seq=ckpt.committed_seq, step=ckpt.committed_step,
                    resumed_from=restored.seq if restored is not None else None,
                    resumed_step=restored.step if restored is not None else None)
    return meta


CairnPythonOperator.__doc__ = with_resume_params(CairnPythonOperator.__doc__)
