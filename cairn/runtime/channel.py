"""The files the supervisor and the sidecar container share: a preemption notice and a status.

On Kubernetes the sidecar cannot signal the supervisor (no shared PID namespace, by design), so
they talk through two small JSON files on the pod's shared ``emptyDir``:

* ``notice.json``, written by the sidecar when a watcher hears of a preemption or maintenance:
  ``{"version": 1, "source", "reason", "issued_at", "deadline"}`` (Unix times). The supervisor
  polls it (one ``stat`` a second) and takes it by renaming it to ``notice.taken.json``, so a
  restarted supervisor in the same pod does not act on it again.
* ``status.json``, written by the supervisor after each snapshot: the counters the sidecar
  serves as Prometheus metrics.
* ``cause.json`` and ``terminating.json`` (ADR 0028): why the pod is being stopped. A native
  sidecar gets its SIGTERM only after the main container has exited, so it cannot tell the
  supervisor on its own: a sidecar that can find out (``cairn sidecar --owner-job``: its Job's
  ``spec.suspend``) writes an unanswered :class:`Cause` at start; a supervisor that gets SIGTERM
  and finds one asks (``terminating.json``, :func:`ask_cause`), takes its final snapshot, and
  reads the answer (:func:`await_cause`). Without either file a SIGTERM is a preemption, as
  before.

Both are written to a temporary name in the same directory and renamed over the target, so a
reader sees the old or the new file, never half of one. Stdlib only: the supervisor imports it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cairn.exceptions import ConfigError

CHANNEL_VERSION = 1
NOTICE_NAME = "notice.json"
TAKEN_NAME = "notice.taken.json"
STATUS_NAME = "status.json"
CAUSE_NAME = "cause.json"
TERMINATING_NAME = "terminating.json"
# The channel's files are read by the sidecar and the supervisor, which may run as different
# users: readable by all (they hold no secret: a notice, a status, a cause).
CHANNEL_FILE_MODE = 0o644
# After the final snapshot, how long the sidecar's answer to an ask (ADR 0028) is awaited, and
# how much of the budget is left untouched by the wait: a SIGKILL before the exit would leave
# no outcome at all.
CAUSE_WAIT_S = 3.0
CAUSE_EXIT_MARGIN_S = 0.5


def write_json_atomic(path: str, doc: dict[str, Any], *, mode: int) -> None:
    """Write ``doc`` to ``path`` through a temporary file and a rename; the file has ``mode``
    from the moment it is named ``path`` (each caller says who may read it: the channel's
    files are read by the sidecar, which may run as another user, a spool's only by its
    group)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, sort_keys=True)
            f.flush()
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable cairn channel file ({e}); remove it") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} does not hold a JSON object; remove it")
    return doc


@dataclass(frozen=True)
class Notice:
    """A preemption or maintenance notice: ``deadline`` is when the platform will stop the pod
    (Unix seconds), as well as the sidecar knows it."""

    source: str  # "gce-preempted", "gce-maintenance", "node-label", "sigterm"
    reason: str
    issued_at: float
    deadline: float

    def seconds_left(self, now: float | None = None) -> float:
        return self.deadline - (time.time() if now is None else now)

    def to_json(self) -> dict[str, Any]:
        return {"version": CHANNEL_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Notice:
        if doc.get("version") != CHANNEL_VERSION:
            raise ConfigError(f"notice version {doc.get('version')!r} is not {CHANNEL_VERSION}; "
                              "run the same cairn version in the sidecar and the main container")
        try:
            notice = cls(source=str(doc["source"]), reason=str(doc["reason"]),
                         issued_at=float(doc["issued_at"]), deadline=float(doc["deadline"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed notice ({e!r}): {doc}") from None
        if not (math.isfinite(notice.issued_at) and math.isfinite(notice.deadline)):
            raise ConfigError(f"notice times must be finite: {doc}")
        return notice


def write_notice(path: str, notice: Notice) -> None:
    write_json_atomic(path, notice.to_json(), mode=CHANNEL_FILE_MODE)


def take_notice(path: str) -> Notice | None:
    """The pending notice at ``path``, moved aside so that it is acted on once; None when there
    is none. Cheap when there is none (one failed ``rename``)."""
    taken = os.path.join(os.path.dirname(os.path.abspath(path)), TAKEN_NAME)
    try:
        os.replace(path, taken)
    except FileNotFoundError:
        return None
    doc = _read_json(taken)
    return None if doc is None else Notice.from_json(doc)


def read_notice(path: str) -> Notice | None:
    """The pending notice without taking it (for the sidecar and tests)."""
    doc = _read_json(path)
    return None if doc is None else Notice.from_json(doc)


@dataclass(frozen=True)
class RunStatus:
    """What the supervisor (process mode) or the Checkpointer (state mode) reports after each
    snapshot (cumulative for its run)."""

    pid: int
    started_at: float
    snapshots: int = 0
    failures: int = 0
    frozen_seconds: float = 0.0
    stall_seconds: float = 0.0  # dump wall time: what a snapshot costs the workload end to end
    gpu_stall_seconds: float = 0.0  # process mode: GPU work stopped, CUDA lock to unlock
    bytes_written: int = 0
    spooled: int = 0  # dumps handed to the sidecar's uploader (cairn run --spool)
    last_seq: int | None = None
    last_success_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    resumes: int = 0
    work_saved_seconds: float = 0.0  # workload run time a restore did not have to redo
    work_saved_steps: int = 0  # state mode: training steps a restore did not have to redo
    notices: dict[str, int] = field(default_factory=dict)
    updated_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"version": CHANNEL_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RunStatus:
        fields = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**fields)
        except TypeError as e:
            raise ConfigError(f"malformed status ({e}): {doc}") from None


def write_status(path: str, status: RunStatus) -> None:
    write_json_atomic(path, status.to_json(), mode=CHANNEL_FILE_MODE)


def read_status(path: str) -> RunStatus | None:
    doc = _read_json(path)
    return None if doc is None else RunStatus.from_json(doc)


@dataclass(frozen=True)
class Cause:
    """The sidecar's answer to the supervisor's SIGTERM (``asked_at`` echoes the ask; None: none
    yet, the sidecar only says it can answer). ``suspended``: the pod's Job was suspended (Kueue
    evicts a workload so), and the try ends ``suspended`` rather than ``preempted``."""

    suspended: bool
    reason: str
    asked_at: float | None = None
    checked_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"version": CHANNEL_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Cause:
        try:
            asked = doc.get("asked_at")
            return cls(suspended=doc["suspended"] is True, reason=str(doc["reason"]),
                       asked_at=None if asked is None else float(asked),
                       checked_at=float(doc.get("checked_at", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed cause ({e!r}): {doc}") from None


def write_cause(directory: str, cause: Cause) -> None:
    write_json_atomic(os.path.join(directory, CAUSE_NAME), cause.to_json(),
                      mode=CHANNEL_FILE_MODE)


def read_cause(directory: str) -> Cause | None:
    doc = _read_json(os.path.join(directory, CAUSE_NAME))
    return None if doc is None else Cause.from_json(doc)


def ask_cause(directory: str, *, signal_name: str) -> float | None:
    """Ask the sidecar why the pod is being stopped, if it said it can answer: the ask's time
    (to match the answer), or None when no sidecar answers here. Best effort: never raises."""
    try:
        if read_cause(directory) is None:
            return None
        asked_at = time.time()
        write_json_atomic(os.path.join(directory, TERMINATING_NAME),
                          {"version": CHANNEL_VERSION, "signal": signal_name, "at": asked_at},
                          mode=CHANNEL_FILE_MODE)
        return asked_at
    except (ConfigError, OSError):
        return None


def read_ask(directory: str) -> float | None:
    """When the supervisor asked (for the sidecar); None when it has not."""
    doc = _read_json(os.path.join(directory, TERMINATING_NAME))
    if doc is None:
        return None
    try:
        return float(doc["at"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"malformed {TERMINATING_NAME}: {doc}") from None


def cause_wait_s(budget_left_s: float) -> float:
    """How long to await the sidecar's answer when ``budget_left_s`` of the final budget is
    left: at most :data:`CAUSE_WAIT_S`, and never into the budget's last
    :data:`CAUSE_EXIT_MARGIN_S`."""
    return max(0.0, min(CAUSE_WAIT_S, budget_left_s - CAUSE_EXIT_MARGIN_S))


def await_cause(directory: str, asked_at: float, *, timeout_s: float,
                poll_s: float = 0.05) -> Cause | None:
    """The sidecar's answer to the ask made at ``asked_at``, waiting at most ``timeout_s``;
    None when none came (or it cannot be read)."""
    end = time.monotonic() + max(timeout_s, 0.0)
    while True:
        try:
            cause = read_cause(directory)
        except ConfigError:
            cause = None
        if cause is not None and cause.asked_at == asked_at:
            return cause
        if time.monotonic() >= end:
            return None
        time.sleep(poll_s)
