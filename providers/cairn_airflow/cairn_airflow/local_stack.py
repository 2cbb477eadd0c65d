"""A throwaway local Airflow 3 deployment, for ``make demo`` and the end-to-end tests:
api-server, scheduler and dag-processor as separate processes, LocalExecutor, SQLite.

It is what ``airflow standalone`` runs: api-server, scheduler, dag-processor and (unless
``triggerer=False``) the triggerer, which runs deferred tasks' triggers (a suspended cairn
task waits there), with its own AIRFLOW_HOME, a free port and short parse/heartbeat
intervals, and the ``cairn_default`` connection naming a local store. ``env`` adds variables
for every component and the tasks they start (``CAIRN_SUSPEND_POLL``, say). REST calls go through the api-server. Authentication is the simple auth manager with
``all_admins`` (every request is an admin): for a laptop or a test, never for a deployment.
Nothing here imports Airflow; it starts Airflow's CLI with this interpreter.

``executor=Executor.CELERY`` makes it a multi-worker cluster instead (root only): PostgreSQL as
the metadata DB and Redis as the Celery broker (``cairn_airflow.local_services``, under
``home``), the same Airflow components on PostgreSQL, and Celery workers standing for separate
nodes (``nodes``: their names), each in namespaces of its own with its own local disk
(``cairn_airflow.local_nodes``). The nodes share nothing but the store, so ``store`` must then
be a URL every node reaches (``gs://...`` on a GCS server, whose ``STORAGE_EMULATOR_HOST``
goes in ``env``). A dead worker's Celery message is never redelivered within the broker's
visibility timeout (6 h here): Airflow retries a task whose worker vanished after
``task_instance_heartbeat_timeout``.
"""

from __future__ import annotations

import enum
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime import env as contract
from cairn.store import store_kind, url_forms

TERMINAL_RUN_STATES = {"success", "failed"}
# Longer than any run of the stack: a dead worker's task comes back through the heartbeat
# timeout, never through the broker redelivering its message to another worker.
CELERY_VISIBILITY_TIMEOUT_S = 6 * 3600


def commits_after(seqs: Callable[[], Iterable[int]], after: int, *, count: int = 2
                  ) -> Callable[[], bool]:
    """A wait condition for :meth:`AirflowStack.wait_for`: ``count`` snapshots with seqs above
    ``after`` were seen committed (``seqs`` lists the key's committed seqs now). With two, the
    second was taken after the wait began: a dump under way then may have frozen the workload
    before the point waited for and commits first (dumps go one at a time). Seqs are kept as
    seen, not counted in the store: it keeps the newest three, so their count stops growing."""
    seen: set[int] = set()

    def enough_seen() -> bool:
        seen.update(seq for seq in seqs() if seq > after)
        return len(seen) >= count
    return enough_seen


# How long wait_for_run waits before calling a run hung: far above what any example run took
# on a loaded 2-core CI host (the zombie-fencing run took 440 s there, beside three suites).
RUN_HANG_S = 900


class Executor(str, enum.Enum):
    """Where the stack runs tasks: LocalExecutor on SQLite (one machine), or CeleryExecutor on
    PostgreSQL and Redis with a worker per node."""

    LOCAL = "local"
    CELERY = "celery"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AirflowStack:
    """Start with :meth:`start`, stop with :meth:`stop` (kills every component's group)."""

    def __init__(self, home: Path, dags: Path, *, store: Path | str, port: int | None = None,
                 triggerer: bool = True, env: Mapping[str, str] | None = None,
                 executor: Executor | str = Executor.LOCAL,
                 nodes: Sequence[str] = ("nodeA", "nodeB"), worker_concurrency: int = 1) -> None:
        self.home = home
        self.triggerer = triggerer
        self.dags = dags
        self.store = store
        try:
            self.executor = Executor(executor)
        except ValueError:
            raise ConfigError(f"executor {executor!r}: use one of "
                              f"{', '.join(e.value for e in Executor)}") from None
        if self.executor is Executor.CELERY and not store_kind(str(store)).remote:
            raise ConfigError(f"a Celery cluster's nodes share no disk: store {store} must be "
                              f"a bucket every node reaches ({url_forms(remote=True)})")
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        home.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("AIRFLOW", contract.PREFIX))}
        self.env.update({
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__BASE_URL": self.base,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_SEC": "2",
            # A task whose worker died is retried after this (a zombie may still run meanwhile).
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "AIRFLOW_CONN_CAIRN_DEFAULT": json.dumps(
                {"conn_type": "cairn", "extra": {"store_url": str(store)}}),
            # A fired trigger's task is picked up at the scheduler's next loop.
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
            # Its own log server port, so that two stacks (or a demo) can run side by side.
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        })
        self.services: list[Any] = []
        self.nodes: dict[str, Any] = {}
        if self.executor is Executor.CELERY:
            self._celery(nodes, worker_concurrency=worker_concurrency)
        self.env.update(env or {})
        for node in self.nodes.values():
            node.env.update(self.env)

    # -- lifecycle ------------------------------------------------------------------------

    def _celery(self, names: Sequence[str], *, worker_concurrency: int) -> None:
        from cairn_airflow.local_nodes import WorkerNode
        from cairn_airflow.local_services import PostgresServer, RedisServer

        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"nodes {list(names)!r}: give one or more distinct names")
        self.home.chmod(0o755)  # PostgreSQL's account must enter it
        self.postgres = PostgresServer(self.home / "postgres")
        self.redis = RedisServer(self.home / "redis")
        self.services = [self.postgres, self.redis]
        self.env.update({
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.postgres.url,
            "AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE": "2",
            "AIRFLOW__CELERY__BROKER_URL": self.redis.url,
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.postgres.url,
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT":
                str(CELERY_VISIBILITY_TIMEOUT_S),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(worker_concurrency),
            # Every worker slot can be busy at once.
            "AIRFLOW__CORE__PARALLELISM": str(max(4, worker_concurrency * len(names))),
            # One task per worker slot and no message held in reserve: a task waits in the
            # broker for a free worker instead of behind a busy (or frozen) one.
            "AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER": "1",
            # A worker that loses the broker reconnects (Celery's broker_connection_retry,
            # on by default) and lets its running tasks run: Celery 6 is to cancel them
            # instead, which would turn a broker restart into a retry of every running
            # step. Nothing is redelivered meanwhile (the visibility timeout above).
            "AIRFLOW__CELERY__EXTRA_CELERY_CONFIG": json.dumps(
                {"worker_cancel_long_running_tasks_on_connection_loss": False}),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
            # A scheduler fails only the heartbeat-less tasks it queued itself: one started
            # again (after the DB went away, say) takes its dead predecessor's over once that
            # one's heartbeat is this old, at its start and then every check interval
            # (Airflow: 30 s and 300 s).
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "10",
        })
        for index, name in enumerate(names):
            self.nodes[name] = WorkerNode(name, cluster=self.home, dags=self.dags, env={},
                                          concurrency=worker_concurrency,
                                          log=self.home / f"worker-{name}.log",
                                          pid_base=1000 + 4000 * index)

    def start(self, *, timeout: float = 180) -> None:
        for service in self.services:
            service.start()
        done = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=self.env,
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"airflow db migrate failed:\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-2000:]}")
        for name, args in self.components():
            self._spawn(name, args)
        for node in self.nodes.values():
            node.start()
        self.wait_healthy(timeout=timeout)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "airflow", *args], env=self.env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def restart_exited(self) -> list[str]:
        """Start again every Airflow component whose process has ended (what systemd's
        ``Restart=always`` or a Kubernetes Deployment does: Airflow's scheduler and
        dag-processor exit when the metadata DB goes away); returns their names. Call
        :meth:`wait_healthy` after."""
        restarted = []
        for name, args in self.components():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                with open(self.home / f"{name}.log", "ab") as log:
                    log.write(f"--- {time.strftime('%H:%M:%S')} {name} exited with "
                              f"{proc.returncode}; starting it again\n".encode())
                self._spawn(name, args)
                restarted.append(name)
        return restarted

    def recover(self, *, timeout: float = 180, settle: float = 15) -> list[str]:
        """After an outage of a server the stack uses: start again every component that exits,
        until the stack is healthy and none has exited for ``settle`` seconds (what systemd's
        ``Restart=always`` does; a component may exit some seconds after the server is back,
        once it notices the connection it lost). Returns the names started again, once per
        start. Raises RuntimeError naming the stack's logs when not healthy within
        ``timeout``."""
        deadline = time.monotonic() + timeout
        restarted: list[str] = []
        while True:
            restarted += self.restart_exited()
            try:
                self.wait_healthy(timeout=max(1.0, deadline - time.monotonic()))
                time.sleep(settle)
                self._check_alive()
                return restarted
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise

    def wait_healthy(self, *, timeout: float = 180) -> None:
        """Until the api-server answers, the scheduler (and triggerer) report healthy and
        every worker node is ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                health = self.get("/api/v2/monitor/health")
                if all(health.get(part, {}).get("status") == "healthy"
                       for part in ("scheduler", *(("triggerer",) if self.triggerer else ()))) \
                        and all(node.ready() for node in self.nodes.values()):
                    return
            except (OSError, ValueError, RuntimeError):  # not up yet, or no DB behind it yet
                pass
            time.sleep(1)
        raise RuntimeError(f"the Airflow stack was not healthy within {timeout:.0f}s\n"
                           + self.logs_tail())

    def components(self) -> list[tuple[str, list[str]]]:
        """The Airflow processes to start: each one's name and ``airflow`` arguments."""
        parts = [("api-server", ["api-server", "--port", str(self.port)]),
                 ("scheduler", ["scheduler"]), ("dag-processor", ["dag-processor"])]
        if self.triggerer:
            parts.append(("triggerer", ["triggerer"]))
        return parts

    def stop(self) -> None:
        """Stop the workers, the Airflow components, then the servers they used."""
        for node in self.nodes.values():
            node.stop()
        self._stop_components()
        for service in reversed(self.services):
            service.stop()

    def restart_node(self, name: str, *, timeout: float = 120) -> None:
        """Start node ``name``'s worker again (after :meth:`WorkerNode.kill` and maybe
        :meth:`WorkerNode.wipe`: a fresh disk gets a fresh copy of the DAGs) and wait until
        Celery says it is ready."""
        node = self.nodes[name]
        node.start()
        self.wait_for(node.ready, what=f"node {name}'s worker to be ready", timeout=timeout)

    def _stop_components(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"airflow {name} exited with {proc.returncode}\n"
                                   + self.logs_tail())

    def logs_tail(self, chars: int = 3000) -> str:
        out = []
        for name in [*self.procs, *(f"worker-{n}" for n in self.nodes)]:
            path = self.home / f"{name}.log"
            if path.exists():
                out.append(f"--- {name}.log ---\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    # -- REST -----------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def mark_failed(self, dag_id: str, run_id: str, task_id: str) -> None:
        """What "mark failed" in the UI does: the server sends SIGTERM to the task's process
        group, and SIGKILL 5 s later."""
        self.request("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}",
                     {"new_state": "failed"})

    def clear(self, dag_id: str, run_id: str, task_id: str) -> None:
        """What "clear" in the UI does: the task instance runs again (a new try)."""
        self.request("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances",
                     {"dry_run": False, "dag_run_id": run_id, "task_ids": [task_id],
                      "only_failed": True, "reset_dag_runs": True})

    def wait_for_dag(self, dag_id: str, *, timeout: float = 120) -> None:
        """Until the dag-processor has parsed ``dag_id`` (then unpause it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                self.get(f"/api/v2/dags/{dag_id}")
                self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
                return
            except RuntimeError:
                time.sleep(1)
        raise RuntimeError(f"DAG {dag_id} was not parsed within {timeout:.0f}s\n"
                           + self.logs_tail())

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        self.wait_for_dag(dag_id)
        run = self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns",
                           {"logical_date": None, "conf": conf})
        return run["dag_run_id"]

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")

    def wait_for(self, predicate: Any, *, what: str, timeout: float, every: float = 0.25) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            value = predicate()
            if value:
                return value
            time.sleep(every)
        raise TimeoutError(f"{what}: not within {timeout:.0f}s\n" + self.logs_tail())

    def wait_for_run(self, dag_id: str, run_id: str, *, timeout: float = RUN_HANG_S) -> str:
        """The run's terminal state. ``timeout`` only stops a run that hangs: how long a run
        takes is the test's business, never an assertion here."""
        def finished() -> str | None:
            state = self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
            return state if state in TERMINAL_RUN_STATES else None

        return self.wait_for(finished, what=f"run {run_id} of {dag_id} to finish",
                             timeout=timeout, every=1)

    def cairn_request(self, kind: str, dag_id: str, run_id: str, task_id: str, *,
                      reason: str | None = None) -> Any:
        """What the snapshots page's suspend or resume button does (``kind``), through the
        page's JSON API."""
        from urllib.parse import urlencode

        query = urlencode({"dag_id": dag_id, "task_id": task_id, "run_id": run_id,
                           "map_index": -1})
        return self.request("POST", f"/cairn/api/snapshots/{kind}?{query}",
                            {"reason": reason})

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        entry = self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
                         f"/xcomEntries/{key}?deserialize=true&stringify=false")
        return entry["value"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        doc = self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
                       f"/logs/{try_number}?full_content=true")
        content = doc.get("content", "")
        if isinstance(content, list):
            return "\n".join(str(c.get("event", c)) if isinstance(c, dict) else str(c)
                             for c in content)
        return str(content)
