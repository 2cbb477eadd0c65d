"""Celery workers that stand for separate nodes on one machine, for a throwaway multi-worker
Airflow (``cairn_airflow.local_stack`` with ``executor="celery"``).

Each worker runs ``airflow celery worker -n <name>@<name>`` inside namespaces of its own
(``unshare``, root only): a UTS namespace (its host name is the node's name, so what cairn
records about where a try ran names the node), a PID namespace (its tasks' PIDs are its own, as
on another machine, handed out from ``pid_base`` up so that a PID in a log tells the nodes
apart; killing its first process kills everything in it, as a vanished node) and
a mount namespace with a private ``/tmp`` and ``/dev/shm`` (tmpfs) and its local directory
``nodes/<name>`` bind-mounted at ``node/``, the one path every node uses for its local disk
(staging, ``cairn run``'s work directory, task logs, its own copy of the DAGs folder), with
``nodes/`` itself hidden so that no node sees another's. The nodes share nothing but what the
caller passes in their environment: the store URL, the metadata DB and the broker.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from cairn.exceptions import ConfigError
from cairn.runtime import env as contract

#: The script the namespace's first process runs (bash, then exec'd into the worker).
_NODE_INIT = """\
set -euo pipefail
IFS=: read -r -a keep <<< "${LOCAL_NODE_KEEP:-}"
host_tmp="$LOCAL_NODE_DIR/.host-tmp"
if ((${#keep[@]})); then mkdir -p "$host_tmp"; mount --rbind /tmp "$host_tmp"; fi
mount -t tmpfs -o mode=1777 cairn-node-tmp /tmp
for dir in "${keep[@]}"; do
    mkdir -p "/tmp/$dir"
    mount --rbind "$host_tmp/$dir" "/tmp/$dir"
done
if ((${#keep[@]})); then umount -l "$host_tmp"; fi
mount -t tmpfs -o mode=1777 cairn-node-shm /dev/shm
mount --bind "$LOCAL_NODE_DIR" "$LOCAL_NODE_MOUNT"
mount -t tmpfs -o ro,mode=0755 cairn-nodes-hidden "$LOCAL_NODES_DIR"
hostname "$LOCAL_NODE_NAME"
echo "$LOCAL_NODE_PID_BASE" > /proc/sys/kernel/ns_last_pid
mount --bind "$LOCAL_NODE_MOUNT/hosts" /etc/hosts
cd "$LOCAL_NODE_MOUNT"
unset LOCAL_NODE_DIR LOCAL_NODE_MOUNT LOCAL_NODES_DIR LOCAL_NODE_NAME LOCAL_NODE_PID_BASE \
    LOCAL_NODE_KEEP
exec "$@"
"""


def _host_tmp_dirs() -> list[str]:
    """The entries of the host's ``/tmp`` that hold this interpreter or cairn's code (a
    checkout cloned into /tmp, its virtual environment): a node's private ``/tmp`` would hide
    them, so the node init binds them back in (node-local files stay private)."""
    import cairn

    found = set()
    for path in (sys.prefix, sys.executable, os.path.dirname(cairn.__file__), *sys.path):
        real = os.path.realpath(path) if path else ""
        if real.startswith("/tmp/"):
            found.add(real.split("/")[2])
    return sorted(found)


class WorkerNode:
    """One Celery worker in namespaces of its own; :meth:`start`, :meth:`kill` (the node
    vanishes), :meth:`wipe` (its local disk is gone), :meth:`stop`."""

    def __init__(self, name: str, *, cluster: Path, dags: Path, env: Mapping[str, str],
                 concurrency: int = 1, log: Path, pid_base: int = 1000) -> None:
        if not name.isalnum():
            raise ConfigError(f"node name {name!r}: use letters and digits only (it is a host "
                              "name and a Celery node name)")
        self.name = name
        self.cluster = cluster
        self.dir = cluster / "nodes" / name  # this node's local disk, seen from the host
        self.mount = cluster / "node"        # where the node sees it
        self.source_dags = dags
        self.concurrency = concurrency
        self.log = log
        self.env = dict(env)
        self.pid_base = pid_base
        self.proc: subprocess.Popen[bytes] | None = None

    # -- paths as the node sees them ----------------------------------------------------

    @property
    def dags(self) -> Path:
        return self.mount / "dags"

    @property
    def celery_name(self) -> str:
        return f"{self.name}@{self.name}"

    def node_env(self) -> dict[str, str]:
        """The worker's environment: the cluster's, with its local paths."""
        return {**self.env,
                "AIRFLOW_HOME": str(self.mount / "home"),
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags),
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.mount / "logs"),
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.concurrency),
                contract.WORKDIR.name: str(self.mount / "workdir")}

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            raise ConfigError("a worker node needs root and util-linux's unshare (its own "
                              "mount, PID and UTS namespaces): run as root after "
                              "scripts/install_cluster_services.sh")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        for sub in ("home", "logs", "workdir"):
            (self.dir / sub).mkdir(exist_ok=True)
        if not (self.dir / "dags").exists():
            shutil.copytree(self.source_dags, self.dir / "dags",
                            ignore=shutil.ignore_patterns("__pycache__"))
        (self.dir / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {self.name}\n"
                                        "::1 localhost ip6-localhost ip6-loopback\n")
        argv = ["unshare", "--mount", "--propagation", "private", "--uts", "--pid", "--fork",
                "--mount-proc", "--kill-child", "--", "bash", "-c", _NODE_INIT, "cairn-node",
                sys.executable, "-m", "airflow", "celery", "worker",
                "--celery-hostname", self.celery_name, "--concurrency", str(self.concurrency),
                "--skip-serve-logs", "--without-mingle", "--without-gossip"]
        env = {**self.node_env(), "LOCAL_NODE_KEEP": ":".join(_host_tmp_dirs()),
               "LOCAL_NODE_DIR": str(self.dir),
               "LOCAL_NODE_MOUNT": str(self.mount), "LOCAL_NODES_DIR": str(self.dir.parent),
               "LOCAL_NODE_NAME": self.name, "LOCAL_NODE_PID_BASE": str(self.pid_base)}
        with open(self.log, "ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} starting node {self.name}: "
                      f"{shlex.join(argv[:10])} ...\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """Celery said the worker is ready (since the last start)."""
        if not self.log.exists():
            return False
        text = self.log.read_text(errors="replace")
        last = text.rfind(f"starting node {self.name}:")
        return f"{self.celery_name} ready" in text[last:]

    def init_pid(self) -> int | None:
        """The host PID of the namespace's first process (the worker), once it is in."""
        if not self.alive():
            return None
        assert self.proc is not None
        for child in _children(self.proc.pid):
            return child
        return None

    def processes(self) -> list[int]:
        """Host PIDs of every process in the node's PID namespace."""
        init = self.init_pid()
        if init is None:
            return []
        try:
            ns = os.readlink(f"/proc/{init}/ns/pid")
        except OSError:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        out.append(int(entry))
                except OSError:
                    continue
        return sorted(out)

    def host_pid(self, node_pid: int) -> int:
        """The host PID of the node's process ``node_pid`` (a PID as the node sees it: what
        Airflow records for a task instance that ran there)."""
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("NSpid:"):
                            if int(line.split()[-1]) == node_pid:
                                return pid
                            break
            except OSError:
                continue
        raise LookupError(f"node {self.name} has no process {node_pid}")

    def kill(self) -> None:
        """The node vanishes: SIGKILL to the namespace's first process ends every process in
        the namespace at once (the kernel kills a PID namespace with its init)."""
        init = self.init_pid()
        if init is not None:
            try:
                os.kill(init, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def wipe(self) -> None:
        """Delete the node's local disk (staging, work directory, logs, its DAGs)."""
        if self.alive():
            raise RuntimeError(f"node {self.name} is running; kill it before wiping its disk")
        shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self, *, timeout: float = 20) -> None:
        """Warm shutdown (SIGTERM to the worker), then :meth:`kill`."""
        if not self.alive():
            return
        init = self.init_pid()
        if init is not None:
            try:
                os.kill(init, signal.SIGTERM)
            except ProcessLookupError:
                pass
        assert self.proc is not None
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (host PIDs), parents before children."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(_children(current))
    return out
