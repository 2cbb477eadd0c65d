"""A real single-host SLURM cluster for the tests: MUNGE, ``slurmctld`` and ``slurmd`` from
Debian's packages (``scripts/install_slurm.sh``), started here without systemd.

Everything the daemons write lives under one temporary directory (configuration, munge key and
socket, state, spool, logs, PID files), on ports picked free at start. The configuration is
what a site that preempts by partition would run: ``preempt/partition_prio`` with
``PreemptMode=REQUEUE``, a ``low`` partition (the default, ``GraceTime``) below a ``high`` one,
``proctrack/linuxproc`` and ``task/none`` (no cgroups needed). :meth:`SlurmCluster.stop`
stops every daemon it started and removes the directory.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
# A requeued job may start again only this long after it ended (SLURM's default: 120 s).
CRED_EXPIRE_S = 5
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo")


def slurm_missing() -> str | None:
    """Why a cluster cannot start here (None when it can): root and the binaries are needed."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their users)"
    missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None]
    if missing:
        return f"needs {', '.join(missing)} (make test installs them: scripts/install_slurm.sh)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Timing:
    """The seconds SLURM gives a job to stop: ``grace_s`` (the low partition's GraceTime,
    from preemption to the kill) and ``kill_wait_s`` (KillWait, from the kill's SIGTERM to its
    SIGKILL)."""

    grace_s: int = 20
    kill_wait_s: int = 15


@dataclass
class SlurmCluster:
    """One running cluster; use :meth:`start`, then :meth:`stop` (always)."""

    root: Path
    timing: Timing
    node: str = field(default_factory=lambda: socket.gethostname())
    cluster_name: str = "cairntest"
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    # -- life -----------------------------------------------------------------------------

    @classmethod
    def start(cls, *, timing: Timing = Timing()) -> SlurmCluster:
        # Short: slurmd's step sockets live under the spool and must fit in sun_path.
        root = Path(tempfile.mkdtemp(prefix="cslurm-", dir="/tmp"))
        cluster = cls(root=root, timing=timing)
        try:
            cluster._write_files()
            cluster._start_daemons()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self) -> None:
        """Cancel what is still queued, stop the daemons (slurmd first), remove the files."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"],
                           env=self.env(), capture_output=True, timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._kill_leftover_steps()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftover_steps(self) -> None:
        """slurmstepd processes (and their jobs) this cluster started, should any outlive
        slurmd: found by the spool directory on their command line or environment."""
        marker = str(self.root).encode()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                environ = Path(f"/proc/{name}/environ").read_bytes()
            except OSError:
                continue
            if b"SLURM_CONF=" + marker in environ:
                try:
                    os.kill(int(name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- files ----------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def log(self, name: str) -> str:
        """A daemon's log so far (for failure messages)."""
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else f"(no {path})"

    def _write_files(self) -> None:
        for sub in ("etc", "munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(mode=0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        t = self.timing
        host = self.node
        cpus = os.cpu_count() or 1
        self.conf.write_text(f"""\
# cairn's test cluster (tests/support/slurm_cluster.py)
ClusterName={self.cluster_name}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/run/slurmctld.pid
SlurmdPidFile={self.root}/run/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd.log
SlurmctldDebug=debug
SlurmdDebug=debug
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=300
KillWait={t.kill_wait_s}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SchedulerParameters=sched_interval=1,bf_interval=1
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=low Nodes={host} Default=YES PriorityTier=1 PreemptMode=REQUEUE \
GraceTime={t.grace_s} MaxTime=INFINITE State=UP
PartitionName=high Nodes={host} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
""")

    # -- daemons --------------------------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a client command (sbatch, scontrol...) runs with."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - kept by the child
        self._procs[name] = subprocess.Popen(argv, env=self.env(), stdin=subprocess.DEVNULL,
                                             stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        out.close()

    def _start_daemons(self) -> None:
        m = self.root / "munge"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={m / 'munge.key'}", f"--log-file={m / 'munged.log'}",
                               f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket", "munged")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._scontrol_ok("ping"), "slurmctld to answer", "slurmctld")
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(self._node_idle, "the node to be idle", "slurmd")

    def _scontrol_ok(self, *args: str) -> bool:
        r = subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True,
                           timeout=30)
        return r.returncode == 0 and "DOWN" not in r.stdout

    def _node_idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(),
                           capture_output=True, text=True, timeout=30)
        return r.returncode == 0 and r.stdout.strip().startswith("idle")

    def _wait(self, ready: Callable[[], bool], what: str, daemon: str,
              timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            proc = self._procs[daemon]
            if proc.poll() is not None or time.monotonic() > deadline:
                out = (self.root / "log" / f"{daemon}.out").read_text(errors="replace")
                raise RuntimeError(f"SLURM test cluster: no {what} ({daemon} "
                                   f"{'exited ' + str(proc.returncode) if proc.poll() is not None else 'timed out'}):"
                                   f"\n{out[-3000:]}\n{self.log(daemon)[-3000:]}")
            time.sleep(0.2)

    # -- jobs -----------------------------------------------------------------------------

    def sbatch(self, script: Path | str, *args: str, options: Sequence[str] = (),
               env: Mapping[str, str] | None = None, cwd: Path | str | None = None) -> int:
        """Submit ``script`` (a path) with sbatch ``options`` and the script's ``args``;
        returns the job id."""
        r = subprocess.run(["sbatch", "--parsable", *options, str(script), *args],
                           env=self.env(env),
                           capture_output=True, text=True, timeout=60, cwd=cwd)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def scontrol(self, *args: str) -> str:
        r = subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, RestartCnt, Reason, ExitCode...)."""
        out = self.scontrol("show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, predicate: Callable[[dict[str, str]], bool], what: str,
                 timeout: float = 120.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if predicate(info):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: timed out after {timeout}s waiting for "
                                     f"{what}; now {info}\nslurmctld:\n"
                                     f"{self.log('slurmctld')[-4000:]}")
            time.sleep(0.2)

    def cancel(self, job_id: int) -> None:
        subprocess.run(["scancel", "--full", "--signal=KILL", str(job_id)], env=self.env(),
                       capture_output=True, timeout=30)
