"""The ``CAIRN_*`` environment contract between the integrations and the runtime, in one place.

Every ``CAIRN_`` variable cairn reads or writes is a :class:`Var` here, and only here: the
integrations (Airflow, KFP, the pod transform) *set* them for a try, the runtime (``cairn run``,
``Checkpointer.from_env()``) *reads* them. ``docs/environment.md`` is generated from
:data:`ALL` (:func:`markdown_table`), and a test keeps the two equal and fails on a ``CAIRN_``
name spelled anywhere else.

Stdlib and :mod:`cairn.exceptions` only; reads ``os.environ`` when asked, never at import.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cairn.exceptions import ConfigError

PREFIX = "CAIRN_"


@dataclass(frozen=True)
class Var:
    """One variable of the contract: its ``name``, what it means, who sets it, who reads it."""

    name: str
    meaning: str
    set_by: str
    read_by: str
    default: str | None = None

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value in ``environ`` (default ``os.environ``); :attr:`default` when unset or
        empty."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value if value else self.default

    def __str__(self) -> str:
        return self.name


STORE = Var("CAIRN_STORE", "the store URL: a directory or a bucket's URL (the forms: "
            "docs/store-backends.md)",
            "every integration", "`Checkpointer.from_env()`, KFP components")
STORE_CONNECT_TIMEOUT = Var(
    "CAIRN_STORE_CONNECT_TIMEOUT", "how long the first contact with a remote store (opening "
    "it, as a try starts) may take, retries included, before the try fails as unreachable "
    "(exit 6), a duration like `30s`", "the user (an operator's env= too)",
    "every process that opens a store", default="30s")
STORE_TRANSFERS = Var(
    "CAIRN_STORE_TRANSFERS", "how many transfers a process keeps in flight to a store (packs "
    "written at once, ranged reads ahead, and threads for them), 1-256; default 16 for a "
    "bucket, 4 writes and 8 reads for a local directory (ADR 0050)", "the user",
    "every process that opens a store")
KEY = Var("CAIRN_KEY", "the step's key, as `Key` text (`a/b/c`, percent-encoded components)",
          "every integration", "`Checkpointer.from_env()`")
EVERY_STEPS = Var("CAIRN_EVERY_STEPS", "snapshot every this many steps",
                  "Airflow operators", "`Checkpointer.from_env()`")
EVERY_SECONDS = Var("CAIRN_EVERY_SECONDS", "snapshot at most this many seconds apart",
                    "Airflow operators, the placement policy", "`Checkpointer.from_env()`")
EXCLUDE_SEQS = Var("CAIRN_EXCLUDE_SEQS",
                   "snapshot seqs this try must not restore (the resume plan), e.g. `12,15`",
                   "the try object (every integration)",
                   "`Checkpointer.from_env()`, `cairn run`")
NOTICE_FILE = Var("CAIRN_NOTICE_FILE", "the sidecar's preemption notice file, polled",
                  "the pod transform", "`cairn run`, the Checkpointer")
SUSPEND_POLL = Var("CAIRN_SUSPEND_POLL", "how often a running try looks in the store for a "
                   "suspend request (`cairn suspend`), a duration like `5s`", "the user",
                   "`cairn run`, the Checkpointer", default="5s")
STATUS_FILE = Var("CAIRN_STATUS_FILE", "where snapshot counters are written for the sidecar's "
                  "metrics", "the pod transform", "`cairn run`, the Checkpointer")
SPOOL_DIR = Var("CAIRN_SPOOL_DIR", "`cairn run` dumps into this spool; the sidecar uploads",
                "the pod transform", "`cairn run`")
WORKDIR = Var("CAIRN_WORKDIR", "`cairn run`'s logs and staging (the same path on every node)",
              "the user", "`cairn run`", default="/var/tmp/cairn/run")
STAGING = Var("CAIRN_STAGING", "where `cairn run` stages a dump without a spool: `auto` "
              "(disk while its page cache takes 1.2 x the last image unthrottled, else memory "
              "when the headroom covers that), `memory` (tmpfs) or `disk` (the work "
              "directory)", "the user", "`cairn run`", default="auto")
RESTORE = Var("CAIRN_RESTORE", "how `cairn run` restores a snapshot: `eager` (every page "
              "in before the workload runs) or `lazy` (it runs while its memory arrives; "
              "GPU snapshots stay eager)", "the user", "`cairn run`", default="eager")
CRIU = Var("CAIRN_CRIU", "the CRIU binary to use (else `criu` on PATH)", "the user",
           "process mode")
IMAGE_DIGEST = Var("CAIRN_IMAGE_DIGEST", "the container image digest, for the compatibility "
                   "record", "the Kubernetes and KFP integrations", "process mode")
PLACEMENT_OPTION = Var("CAIRN_PLACEMENT_OPTION", "the capacity option this try was placed on",
                       "the placement policy", "outcome records")
PLACEMENT_REASON = Var("CAIRN_PLACEMENT_REASON", "why the try was placed there (one line)",
                       "the placement policy", "outcome records")
PLACEMENT_OPTIONS = Var("CAIRN_PLACEMENT_OPTIONS", "the names of every capacity option the "
                        "step may be placed on, a JSON list (what `cairn resume --placement` "
                        "may move a pod-based step to)", "the placement policy",
                        "outcome records")
TRACK_ROOTS = Var("CAIRN_TRACK_ROOTS", "more directories (os.pathsep-separated) whose files a "
                  "process snapshot may track and a restore may write, besides the working "
                  "directory and cairn's log directory", "the user (an operator's env= too)",
                  "process mode (dump and restore)")
CUDA_LIBRARY = Var("CAIRN_CUDA_LIBRARY", "the CUDA driver library process mode loads for the "
                   "checkpoint calls (a path or a name `dlopen` finds); tests point it at the "
                   "fake driver `make fakecuda` builds", "the user, tests", "process mode",
                   default="libcuda.so.1")
NVML_LIBRARY = Var("CAIRN_NVML_LIBRARY", "the NVML library the GPU inventory loads through "
                   "pynvml (`nvidia-smi` is the fallback)", "the user, tests",
                   "process mode, `cairn doctor`", default="libnvidia-ml.so.1")
GPU_MAP = Var("CAIRN_GPU_MAP", "restore a GPU snapshot onto these GPUs: "
              "`OLD_UUID=NEW_UUID,...` (else same model, in visible-device order; driver >= 580)",
              "the user", "process mode (restore)")
SECRET_FILE = Var("CAIRN_SECRET_FILE", "the secret file (`cairn secret new PATH`; a mounted "
                  "Kubernetes Secret) that opens an encrypted store; a new store is created "
                  "encrypted while it is set", "the user, the Airflow connection's extra",
                  "every `cairn` command, `cairn run`, the Checkpointer, the sidecar, the "
                  "integrations")
ALLOW_UNAUTHENTICATED_RESTORE = Var(
    "CAIRN_ALLOW_UNAUTHENTICATED_RESTORE", "`1`: let `cairn run` as root restore a process "
    "snapshot from an unencrypted remote store (refused otherwise: whoever can write the "
    "bucket would choose what runs as root)", "the operator", "`cairn run` (restore)")
ALLOW_ROLLBACK = Var(
    "CAIRN_ALLOW_ROLLBACK", "`1`: begin a try from the newest snapshot the store offers even "
    "when a try of the key committed a newer one that is gone or fails its checks (refused "
    "otherwise: a rollback of the work, ADR 0049); `cairn run --allow-rollback` sets it",
    "the user", "`cairn run`, the Checkpointer")
COMMITTED_DIR = Var(
    "CAIRN_COMMITTED_DIR", "where a try records, per store and key, the newest snapshot seq it "
    "committed, outside the store (the rollback check of ADR 0049 on this machine)",
    "the user; the pod transform in a Job pod, or a bare pod keeping its own (the shared "
    "volume)",
    "`cairn run`, the Checkpointer, the sidecar", default="~/.cache/cairn/committed")
K8S_NAMESPACE = Var("CAIRN_K8S_NAMESPACE", "a pod's namespace (downward API), for its key",
                    "the pod transform (Jobs, JobSets; a bare pod that keeps its committed "
                    "seqs)", "the key's `$(VAR)` expansion, the sidecar's `--owner-job` and "
                    "`--owner-pod`")
K8S_POD = Var("CAIRN_K8S_POD", "a bare pod's own name (downward API)",
              "the pod transform (`committed_in_pod=True`: the Airflow pod operator)",
              "the sidecar's `--owner-pod`")
K8S_JOB = Var("CAIRN_K8S_JOB", "a Job pod's Job name (the `batch.kubernetes.io/job-name` "
              "label, downward API), for its key", "the pod transform (Jobs, JobSets)",
              "the key's `$(VAR)` expansion, the sidecar's `--owner-job`")
K8S_COMPLETION_INDEX = Var("CAIRN_K8S_COMPLETION_INDEX", "a Job pod's completion index (its "
                           "annotation, downward API; `0` for a one-pod NonIndexed Job), for "
                           "its key", "the pod transform (Jobs, JobSets)",
                           "the key's `$(VAR)` expansion")
KFP_DRY_RUN = Var("CAIRN_KFP_DRY_RUN", "`1`: KFP's `run_command` prints the `cairn run` "
                  "command instead of running it", "tests", "KFP's `run_command`")

ALL: tuple[Var, ...] = (STORE, STORE_CONNECT_TIMEOUT, STORE_TRANSFERS, KEY, EVERY_STEPS, EVERY_SECONDS, EXCLUDE_SEQS, NOTICE_FILE,
                        SUSPEND_POLL, STATUS_FILE, SPOOL_DIR, WORKDIR, STAGING, RESTORE, CRIU, IMAGE_DIGEST,
                        PLACEMENT_OPTION, PLACEMENT_REASON, PLACEMENT_OPTIONS, TRACK_ROOTS,
                        CUDA_LIBRARY, NVML_LIBRARY, GPU_MAP, SECRET_FILE, ALLOW_UNAUTHENTICATED_RESTORE,
                        ALLOW_ROLLBACK, COMMITTED_DIR,
                        K8S_NAMESPACE, K8S_POD, K8S_JOB, K8S_COMPLETION_INDEX, KFP_DRY_RUN)
BY_NAME: dict[str, Var] = {var.name: var for var in ALL}


def is_cairn_name(name: str) -> bool:
    """Whether ``name`` is in cairn's namespace (``CAIRN_...``)."""
    return name.startswith(PREFIX)


def markdown_table() -> str:
    """The contract as the table ``docs/environment.md`` holds."""
    lines = ["| variable | meaning | set by | read by | default |", "|---|---|---|---|---|"]
    lines += [f"| `{v.name}` | {v.meaning} | {v.set_by} | {v.read_by} | "
              f"{f'`{v.default}`' if v.default else '–'} |" for v in ALL]
    return "\n".join(lines) + "\n"


def parse_seqs(text: str, *, source: str = "the seq list") -> frozenset[int]:
    """``"12,15"`` → ``{12, 15}`` (the form of ``CAIRN_EXCLUDE_SEQS`` and ``--exclude-seqs``);
    an empty text is the empty set."""
    try:
        seqs = frozenset(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise ConfigError(f"{source} must be comma-separated snapshot seqs, e.g. 12,15; "
                          f"got {text!r}") from None
    if any(seq < 1 for seq in seqs):
        raise ConfigError(f"{source}: snapshot seqs are positive integers; got {text!r}")
    return seqs


def format_seqs(seqs: Iterable[int]) -> str:
    """The inverse of :func:`parse_seqs`, sorted."""
    return ",".join(str(seq) for seq in sorted(seqs))
