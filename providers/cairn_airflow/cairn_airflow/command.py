"""``CairnRunOperator``: run an unmodified command under ``cairn run`` (process mode).

Contract of one try (``execute``):

- the command runs under ``cairn run --store URL --key KEY`` with the task instance's key
  ``(dag_id, task_id, run_id, map_index)`` (never the try number): the supervisor opens the
  attempt where the workload runs and restores the newest compatible snapshot, so every retry
  resumes the same work; a changed script never resumes a stale process (its content hash is
  part of the snapshot's compatibility record);
- the supervisor, and under it the workload, run in a session of their own, so Airflow's kill
  of the task's process group does not strike them before a final snapshot; the supervisor has
  a parent-death signal (SIGTERM), so a task process that dies without warning still lets it
  snapshot and stop;
- its output (the workload's stdout and stderr, echoed by the supervisor) goes to the task log
  line by line as it comes;
- ``on_kill`` only sends SIGTERM to the supervisor and returns: it runs inside Airflow's signal
  handler, and the supervisor decides by its ``grace`` budget whether a final snapshot fits;
- ``execute`` returns the XCom ``cairn`` metadata when the command succeeded (the key is then
  marked done, unless ``keep_snapshots``); a non-zero exit raises the error it stands for
  (:func:`exit_error`; the codes: :mod:`cairn.runtime.exits`): a preemption
  :class:`cairn.exceptions.Preempted`, a fence :class:`cairn.exceptions.Fenced`, a restore that
  failed on the worker's side ``AirflowFailException`` (no retry is spent on it), any other
  code an ``AirflowException`` naming it;
- a suspension (on request, or the key was held suspended when the try started) defers
  the task with a resume trigger instead of failing (no retry used; see
  :mod:`cairn_airflow.suspend`, ``resume_after`` and ``resume_poll``): the supervisor and the
  workload are gone meanwhile; once resumed, ``cairn run`` runs again on a worker and restores
  the process from the suspend snapshot;
- the resume policy (``resume_on``, ``max_error_retries``, ``loop_guard``, ``max_preemptions``;
  see :mod:`cairn_airflow.resume`) reads the key's history before the command starts: the
  snapshots it rules out are passed as ``--exclude-seqs``, and a step that failed too often is
  not started; after a failure it may stop the retries or reschedule a preemption. ``cairn
  run`` records each try's outcome itself;
- the newest snapshot seq the tries committed is kept in Airflow's task state store
  (:mod:`cairn_airflow.committed`): on any worker, ``cairn run`` refuses (exit 2) to restore
  anything older, as when the newer snapshots were deleted from the bucket; ``env=
  {"CAIRN_ALLOW_ROLLBACK": "1"}`` allows it.

Needs, on the worker: root and CRIU 4.x (``cairn doctor`` says what is missing; ``cairn run``
exits 7 before starting the command when the host is not ready).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from cairn.exceptions import ConfigError
from cairn.runtime.durations import format_duration
from cairn.runtime.exits import ExitCode
from cairn_airflow.committed import kept_by_airflow
from cairn_airflow.hooks import (
    DEFAULT_CONN_ID,
    SerializesCairnConnection,
    StoreConfig,
    operator_store_config,
)
from cairn_airflow.operators import XCOM_KEY
from cairn_airflow.task_keys import task_key
from cairn_airflow.resume import begin_try, raise_verdict, resume_policy, with_resume_params
from cairn_airflow.suspend import SuspendDeferral, optional_seconds

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def cairn_executable() -> list[str]:
    """How to start cairn's CLI on this worker: the ``cairn`` script next to this interpreter,
    else on PATH, else ``python -m cairn`` (the same entry point as the script)."""
    beside = os.path.join(os.path.dirname(sys.executable), "cairn")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("cairn")
    return [found] if found else [sys.executable, "-m", "cairn"]


def _duration(value: float | str, name: str) -> str:
    """``value`` as a duration text, checked now unless it is a Jinja template (then it is
    checked once Airflow has rendered it, before the command starts)."""
    if isinstance(value, str) and "{{" in value:
        return value
    return format_duration(value, name=name)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the task's process dies (a SIGKILLed task gives
    no warning; the supervisor then still takes its final snapshot if it fits)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def exit_error(code: int, key: Any) -> Exception:
    """The error a non-zero exit status of ``cairn run`` stands for (see
    :mod:`cairn.runtime.exits`): Preempted, Fenced, Suspended, RestoreFailed and
    RollbackRefused (which :func:`~cairn_airflow.resume.raise_verdict` turns into
    ``AirflowFailException``), else an
    ``AirflowException`` naming it."""
    from airflow.exceptions import AirflowException

    from cairn.runtime.exits import describe_exit, error_for_exit

    return error_for_exit(code, key=key) or AirflowException(describe_exit(code))


class CairnRunOperator(SuspendDeferral, SerializesCairnConnection, BaseOperator):
    """Runs ``command`` under ``cairn run`` so that a retry resumes the process from its last
    snapshot (see the module docstring for the contract of one try).

    :param command: the command and its arguments (a list; not a shell string).
    :param every: time between periodic snapshots (seconds or ``"30s"``, ``"10m"``, ``"1h"``).
    :param grace: seconds a final snapshot may take after SIGTERM (Airflow's kill from the UI
        escalates to SIGKILL after 5 s: keep this below that there).
    :param cwd: the command's working directory (default: the worker's).
    :param env: more environment variables for the command.
    :param keep_snapshots: on success, keep the snapshots instead of marking the key done.
    :param cairn_conn_id: the ``cairn`` connection naming the store.
    :param store_url: the store, overriding the connection.
    :param workdir: ``cairn run --workdir`` (local staging for dumps).
    (The resume options: :data:`cairn_airflow.resume.RESUME_PARAMS_DOC`.)
    """

    template_fields: Sequence[str] = ("command", "env", "cwd", "every", "grace")
    ui_color = "#c8b898"

    def __init__(self, *, command: Sequence[str], every: float | str = "10m",
                 grace: float | str = 4.0, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, keep_snapshots: bool = False,
                 cairn_conn_id: str = DEFAULT_CONN_ID, store_url: str | None = None,
                 workdir: str | None = None, resume_on: str = "any_failure",
                 max_error_retries: int | None = None, loop_guard: bool = True,
                 max_preemptions: int = 0, resume_after: timedelta | float | str | None = None,
                 resume_poll: timedelta | float | str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.resume_after = optional_seconds(resume_after, "resume_after")
        self.resume_poll = optional_seconds(resume_poll, "resume_poll")
        self.resume_policy = resume_policy(resume_on=resume_on,
                                           max_error_retries=max_error_retries,
                                           loop_guard=loop_guard, max_preemptions=max_preemptions)
        if isinstance(command, str) or not command:
            raise ConfigError("command must be a non-empty list such as ['python', 'train.py'] "
                              "(cairn runs it without a shell)")
        self.command = list(command)
        self.every = _duration(every, "every")
        self.grace = _duration(grace, "grace")
        self.cwd = cwd
        self.env = dict(env or {})
        self.keep_snapshots = keep_snapshots
        self.cairn_conn_id = cairn_conn_id
        self.store_url = store_url
        self.workdir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    def store_config(self) -> StoreConfig:
        return operator_store_config(store_url=self.store_url, cairn_conn_id=self.cairn_conn_id)

    def cairn_argv(self, url: str, key: Any, exclude: Collection[int] = ()) -> list[str]:
        from cairn.tries import run_argv

        return run_argv(cairn_executable(), self.command, store=url, key=key, every=self.every,
                        grace=self.grace, exclude=exclude, workdir=self.workdir,
                        keep=self.keep_snapshots)

    def execute(self, context: Any) -> dict[str, Any]:
        key = task_key(context)
        config = self.store_config()
        log.info("cairn: key %s in %s (%s)", key, config.url, config.source)
        self.every = format_duration(self.every, name="every")  # rendered by now
        self.grace = format_duration(self.grace, name="grace")
        this_try = begin_try(config.url, key, self.resume_policy, env=config.env,
                             try_number=getattr(context["ti"], "try_number", None))
        argv = self.cairn_argv(config.url, key, this_try.exclude)
        log.info("cairn: running %s", " ".join(argv))
        env = {**os.environ, **config.env, **self.env}
        # A session of its own: Airflow's group kill must not reach the workload before the
        # supervisor has decided about a final snapshot.
        with kept_by_airflow(context, config.url, key, environ=env):
            proc = self._proc = subprocess.Popen(
                argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
            pump = threading.Thread(target=self._pump, args=(proc,), name="cairn-run-log",
                                    daemon=True)
            pump.start()
            code = proc.wait()
            pump.join(timeout=10)
        self._proc = None
        meta = self._metadata(context, config.url, key, code, plan_reason=this_try.reason)
        if code == 0:
            return meta
        error = exit_error(code, key)
        if code == ExitCode.SUSPENDED:
            self.defer_suspended(context, store_url=config.url, key=key, env=config.env)
            return self.execute(context)  # discarded meanwhile: start afresh
        # cairn run recorded the outcome itself: this only asks for the verdict.
        raise_verdict(this_try, this_try.ended(error=error), error, delay=self.retry_delay)
        raise error

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            log.info("%s", raw.decode(errors="replace").rstrip("\n"))

    def on_kill(self) -> None:
        """Runs in Airflow's SIGTERM handler: tell the supervisor and return at once."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            log.warning("cairn: task killed; asking cairn run (pid %d) for a final snapshot "
                        "within its %s grace", proc.pid, self.grace)
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _metadata(self, context: Any, url: str, key: Any, code: int, *,
                  plan_reason: str) -> dict[str, Any]:
        """The XCom ``cairn``: the newest snapshot and the tries' epochs, read from the store."""
        meta: dict[str, Any] = {"key": str(key), "store": url, "exit_code": code, "seq": None,
                                "step": None, "snapshots": 0, "done": False,
                                "try_number": getattr(context["ti"], "try_number", None),
                                "resume_plan": plan_reason}
        try:
            from cairn import open_store
            from cairn.store import RecordKind

            with open_store(url, create=False) as store:
                history = store.history(key)
                snaps = [r for r in history if r.kind is RecordKind.SNAP]
                meta["snapshots"] = len(snaps)
                meta["done"] = bool(history) and history[-1].kind is RecordKind.DONE
                meta["epochs"] = sorted({r.epoch for r in history})
                if snaps and snaps[-1].manifest is not None:
                    meta["seq"], meta["step"] = snaps[-1].seq, snaps[-1].manifest.step
        except Exception as e:  # noqa: BLE001 - metadata must never fail the task
            log.warning("cairn: could not read the store for the XCom: %s", e)
        try:
            context["ti"].xcom_push(key=XCOM_KEY, value=meta)
        except Exception as e:  # noqa: BLE001
            log.warning("cairn: could not push the %r XCom: %s", XCOM_KEY, e)
        return meta


CairnRunOperator.__doc__ = with_resume_params(CairnRunOperator.__doc__)
