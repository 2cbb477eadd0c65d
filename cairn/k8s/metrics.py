"""Prometheus text exposition (format 0.0.4) of the supervisor's status, written by hand.

No client library: the sidecar image stays small and the format is a few lines. Counters are
cumulative for one supervisor run; a restarted main container starts them again from zero,
which Prometheus reads as a counter reset.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cairn.runtime.channel import RunStatus

if TYPE_CHECKING:
    from cairn.k8s.uploader import UploadStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: list[tuple[Mapping[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {_number(value)}")


def render(status: RunStatus | None, *, notices_sent: Mapping[str, int],
           watchers_healthy: Mapping[str, bool], now: float | None = None,
           uploads: UploadStats | None = None) -> str:
    """The ``/metrics`` page. ``status`` None: the supervisor has not reported yet;
    ``uploads`` None: this sidecar does not upload (``--upload`` not given)."""
    w = _Writer()
    now = time.time() if now is None else now
    w.family("cairn_supervisor_reporting", "gauge",
             "1 when the supervisor has written its status file.",
             [({}, 0 if status is None else 1)])
    w.family("cairn_sidecar_notices_total", "counter",
             "Preemption notices this sidecar wrote for the supervisor, by source.",
             [({"source": s}, n) for s, n in sorted(notices_sent.items())])
    w.family("cairn_sidecar_watcher_healthy", "gauge",
             "1 when the watcher's last poll reached its source.",
             [({"watcher": n}, int(ok)) for n, ok in sorted(watchers_healthy.items())])
    if uploads is not None:
        _uploads(w, uploads)
    if status is not None:
        w.family("cairn_snapshots_total", "counter", "Snapshots committed.",
                 [({}, status.snapshots)])
        w.family("cairn_snapshot_failures_total", "counter", "Snapshots that failed.",
                 [({}, status.failures)])
        w.family("cairn_snapshot_frozen_seconds_total", "counter",
                 "Time the workload was frozen by snapshots.", [({}, status.frozen_seconds)])
        w.family("cairn_snapshot_gpu_stall_seconds_total", "counter",
                 "Time the workload's GPU work was stopped by snapshots (CUDA lock to unlock).",
                 [({}, status.gpu_stall_seconds)])
        w.family("cairn_snapshot_stall_seconds_total", "counter",
                 "Wall time of the dumps (the workload's stall, end to end).",
                 [({}, status.stall_seconds)])
        w.family("cairn_snapshot_bytes_written_total", "counter",
                 "Bytes written to the store after deduplication.", [({}, status.bytes_written)])
        w.family("cairn_snapshots_spooled_total", "counter",
                 "Dumps handed to the sidecar's uploader through the spool.",
                 [({}, status.spooled)])
        w.family("cairn_last_snapshot_success_timestamp_seconds", "gauge",
                 "Unix time of the last committed snapshot (0: none yet).",
                 [({}, status.last_success_at or 0)])
        w.family("cairn_last_snapshot_seq", "gauge", "Seq of the last committed snapshot (-1: none).",
                 [({}, -1 if status.last_seq is None else status.last_seq)])
        w.family("cairn_last_error_timestamp_seconds", "gauge",
                 "Unix time of the last failed snapshot (0: none).",
                 [({}, status.last_error_at or 0)])
        w.family("cairn_last_error_info", "gauge", "The last snapshot error, as a label.",
                 [({"error": status.last_error}, 1)] if status.last_error else [])
        w.family("cairn_resumes_total", "counter",
                 "Runs that resumed from a snapshot instead of starting fresh.",
                 [({}, status.resumes)])
        w.family("cairn_work_saved_seconds_total", "counter",
                 "Workload run time a resume did not have to redo.",
                 [({}, status.work_saved_seconds)])
        w.family("cairn_work_saved_steps_total", "counter",
                 "Training steps a resume did not have to redo (state mode).",
                 [({}, status.work_saved_steps)])
        w.family("cairn_supervisor_notices_total", "counter",
                 "Notices the supervisor acted on, by source.",
                 [({"source": s}, n) for s, n in sorted(status.notices.items())])
        w.family("cairn_status_age_seconds", "gauge",
                 "Seconds since the supervisor last wrote its status.",
                 [({}, max(0.0, round(now - status.updated_at, 3)))])
    return "\n".join(w.lines) + "\n"


def _uploads(w: _Writer, u: UploadStats) -> None:
    w.family("cairn_sidecar_uploads_total", "counter",
             "Spooled snapshots this sidecar committed to the store.", [({}, u.committed)])
    w.family("cairn_sidecar_upload_failures_total", "counter",
             "Upload tries that failed (the entry is kept and retried).", [({}, u.failures)])
    w.family("cairn_sidecar_uploads_dropped_total", "counter",
             "Spooled snapshots never committed, by reason (fenced and invalid are errors).",
             [({"reason": r}, n) for r, n in sorted(u.dropped.items())])
    w.family("cairn_sidecar_upload_bytes_written_total", "counter",
             "Bytes the uploads wrote to the store after deduplication.",
             [({}, u.bytes_written)])
    w.family("cairn_sidecar_upload_seconds_total", "counter",
             "Wall time of the committed uploads.", [({}, u.seconds)])
    w.family("cairn_sidecar_spool_pending", "gauge",
             "Complete spool entries waiting to be uploaded.", [({}, u.pending)])
    w.family("cairn_sidecar_last_upload_seq", "gauge",
             "Seq of the last snapshot this sidecar committed (-1: none).",
             [({}, -1 if u.last_seq is None else u.last_seq)])
    w.family("cairn_sidecar_last_upload_success_timestamp_seconds", "gauge",
             "Unix time of the last committed upload (0: none).",
             [({}, u.last_success_at or 0)])
    w.family("cairn_sidecar_last_upload_error_timestamp_seconds", "gauge",
             "Unix time of the last upload error (0: none).", [({}, u.last_error_at or 0)])
    w.family("cairn_sidecar_last_upload_error_info", "gauge",
             "The last upload error, as a label.",
             [({"error": u.last_error}, 1)] if u.last_error else [])
