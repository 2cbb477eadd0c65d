"""State mode's side of the sidecar's metrics: the Checkpointer's counters in ``status.json``.

In a pod the sidecar serves ``/metrics`` from the status file on the shared volume
(:mod:`cairn.runtime.channel`); ``cairn run`` writes it in process mode, and a Checkpointer given a
status file (``$CAIRN_STATUS_FILE``, set by the pod transform) writes the same document in state
mode: snapshots committed, failures, stall time (the staging copy, what training waited),
bytes written, the last seq and success, the last error, resumes and the steps a resume saved.

Only the training thread calls these methods. Writing is best effort: a status that cannot be
written is logged once and never fails training.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from cairn.runtime import channel, env

log = logging.getLogger(__name__)



class StatusReporter:
    """Cumulative counters of one Checkpointer, rewritten atomically after each change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.status = channel.RunStatus(pid=os.getpid(), started_at=time.time())
        self._warned = False
        self._write()

    @classmethod
    def from_env(cls) -> StatusReporter | None:
        path = env.STATUS_FILE.get()
        return cls(path) if path else None

    def resumed(self, *, seq: int, step: int) -> None:
        # State mode counts work in steps: the snapshot's step + 1 steps are not redone.
        self._update(resumes=self.status.resumes + 1, last_seq=seq,
                     work_saved_steps=self.status.work_saved_steps + step + 1)

    def committed(self, *, seq: int, stall_s: float, bytes_written: int) -> None:
        st = self.status
        self._update(snapshots=st.snapshots + 1, stall_seconds=st.stall_seconds + stall_s,
                     bytes_written=st.bytes_written + bytes_written, last_seq=seq,
                     last_success_at=time.time())

    def failed(self, error: str) -> None:
        self._update(failures=self.status.failures + 1, last_error=error[:500],
                     last_error_at=time.time())

    def notice(self, source: str) -> None:
        notices = dict(self.status.notices)
        notices[source] = notices.get(source, 0) + 1
        self._update(notices=notices)

    def _update(self, **changes: object) -> None:
        self.status = dataclasses.replace(self.status, **changes, updated_at=time.time())
        self._write()

    def _write(self) -> None:
        try:
            channel.write_status(self.path, self.status)
        except OSError as e:
            if not self._warned:
                log.warning("cannot write the status file %s (the sidecar's metrics): %s",
                            self.path, e)
                self._warned = True
