"""A SLURM job's identity, read from the variables SLURM sets in every job's environment.

Under SLURM a try needs no ``CAIRN_KEY``: the job names the work, and a requeued job (after
``scontrol requeue``, a preemption with ``PreemptMode=REQUEUE``, a node failure) keeps its job
id, so its next run finds its own snapshots. :func:`default_key` is what ``cairn run`` and
``Checkpointer.from_env()`` use when no key is given: ``CAIRN_KEY`` when set, else
``slurm/<cluster>/<job id>`` (an array task: ``slurm/<cluster>/<array job id>/<task id>``,
stable across the task's requeues), else nothing. A job resubmitted with ``sbatch`` is a new
job with a new id: give it the old key to continue.

The try is ``SLURM_RESTART_COUNT`` (0 on the first run, +1 per requeue) and the node
``SLURMD_NODENAME``; :meth:`SlurmJob.detail` is what outcome records carry about both.

SLURM signals every process of a job step, not only the one it started (``proctrack``
follows the whole tree). That is why ``cairn run`` starts its workload with SIGTERM ignored
when :func:`job_from_env` finds a job, so that the SIGTERM of a requeue or a preemption reaches the
supervisor (which then takes the final snapshot) without ending the workload first.

Stdlib only; reads ``os.environ`` when asked, never at import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from cairn.exceptions import ConfigError
from cairn.runtime import env

JOB_ID = "SLURM_JOB_ID"
ARRAY_JOB_ID = "SLURM_ARRAY_JOB_ID"
ARRAY_TASK_ID = "SLURM_ARRAY_TASK_ID"
RESTART_COUNT = "SLURM_RESTART_COUNT"
NODE = "SLURMD_NODENAME"
CLUSTER = "SLURM_CLUSTER_NAME"
PARTITION = "SLURM_JOB_PARTITION"
STEP_ID = "SLURM_STEP_ID"

KEY_ROOT = "slurm"


@dataclass(frozen=True)
class SlurmJob:
    """The job this process runs in. ``job_id`` is ``SLURM_JOB_ID``; an array task has
    ``array_job_id`` and ``array_task_id`` too."""

    job_id: str
    restart_count: int = 0
    node: str | None = None
    cluster: str | None = None
    partition: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    step_id: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job named by ``environ`` (default ``os.environ``), or None outside SLURM."""
        e = os.environ if environ is None else environ
        job_id = e.get(JOB_ID, "").strip()
        if not job_id:
            return None
        restarts = e.get(RESTART_COUNT, "").strip() or "0"
        if not restarts.isdigit():
            raise ConfigError(f"{RESTART_COUNT}={restarts!r} is not a count; SLURM sets it to "
                              "the number of times the job was requeued")
        array_job, array_task = e.get(ARRAY_JOB_ID, "").strip(), e.get(ARRAY_TASK_ID, "").strip()
        if bool(array_job) != bool(array_task):
            raise ConfigError(f"{ARRAY_JOB_ID} and {ARRAY_TASK_ID} come together (SLURM sets "
                              f"both in an array task); got {ARRAY_JOB_ID}={array_job!r}, "
                              f"{ARRAY_TASK_ID}={array_task!r}")
        return cls(job_id=job_id, restart_count=int(restarts),
                   node=e.get(NODE, "").strip() or None,
                   cluster=e.get(CLUSTER, "").strip() or None,
                   partition=e.get(PARTITION, "").strip() or None,
                   array_job_id=array_job or None, array_task_id=array_task or None,
                   step_id=e.get(STEP_ID, "").strip() or None)

    @property
    def try_number(self) -> int:
        """1 on the job's first run, 2 after its first requeue, ..."""
        return self.restart_count + 1

    def key_text(self) -> str:
        """The work's key, as ``Key`` text: components percent-encoded by ``Key`` itself
        (a cluster name holds no ``/``, but nothing here relies on it)."""
        parts = [KEY_ROOT, self.cluster or "cluster"]
        if self.array_job_id is not None:
            parts += [self.array_job_id, self.array_task_id or ""]
        else:
            parts.append(self.job_id)
        return "/".join(quote(part, safe="") for part in parts)

    def detail(self) -> dict[str, Any]:
        """What an outcome record says about the job: its id, the try and the node."""
        out: dict[str, Any] = {"job_id": self.job_id, "restart_count": self.restart_count,
                               "try": self.try_number, "node": self.node}
        for name in ("cluster", "partition", "array_job_id", "array_task_id", "step_id"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def job_from_env(environ: Mapping[str, str] | None = None) -> SlurmJob | None:
    """:meth:`SlurmJob.from_env`."""
    return SlurmJob.from_env(environ)


def default_key(environ: Mapping[str, str] | None = None) -> str | None:
    """``CAIRN_KEY`` when set, else the SLURM job's key, else None (module docstring)."""
    given = env.KEY.get(environ)
    if given:
        return given
    job = job_from_env(environ)
    return job.key_text() if job is not None else None
