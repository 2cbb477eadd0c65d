"""The supervisor's side of the spool (``cairn run --spool``, ADR 0014): the sidecar uploads.

``cairn run`` dumps into an entry of the spool on the pod's shared volume and hands it off;
the sidecar's uploader commits it and leaves a verdict (:class:`~cairn.process.spool.Result`).
:class:`SpoolClient` prepares the spool before the attempt opens, takes the verdicts on this
run's entries (handing each to the supervisor's ``account`` callback), and answers what the
supervisor asks before a dump: is the uploader still busy with one, is there room for a final
dump, what became of an entry. Only the supervisor's main thread calls it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from cairn.process.spool import Result, Spool, UploadOutcome

log = logging.getLogger("cairn.run")

UPLOADER_MAX_AGE_S = 10.0  # an uploader heartbeat older than this: no uploader is running


class SpoolClient:
    """``spool`` as this run uses it. ``epoch`` is set once the attempt is open; until then no
    verdict is taken. ``account`` receives every new verdict on this run's entries."""

    def __init__(self, spool: Spool, *, account: Callable[[Result], None]) -> None:
        self.spool = spool
        self.epoch: int | None = None
        self.fenced: Result | None = None  # the uploader could not commit: a newer try exists
        self._account = account
        self._results: dict[str, Result] = {}
        self._waiting = False  # logged that a periodic dump waits for the uploader

    @classmethod
    def prepare(cls, path: str, *, wait_s: float, account: Callable[[Result], None]) -> SpoolClient:
        """Before opening the attempt (which fences every older one): report what an earlier
        run in this pod left, and give the uploader up to ``wait_s`` to commit its dumps —
        once this run opens, they could never be committed."""
        spool = Spool(path)
        spool.ensure()
        spool.sweep_trash()
        for entry in spool.entries():
            if not spool.is_complete(entry):  # an earlier run's dump that never completed
                spool.remove(entry)
        pending = spool.pending()
        if pending and spool.uploader_alive(UPLOADER_MAX_AGE_S):
            log.warning("waiting up to %.0fs for the sidecar to upload %d snapshot(s) an "
                        "earlier run spooled", wait_s, len(pending))
            deadline = time.monotonic() + wait_s
            while pending and time.monotonic() < deadline:
                time.sleep(0.2)
                pending = spool.pending()
        if pending:
            log.warning("%d snapshot(s) an earlier run spooled are not uploaded; this run "
                        "fences them (it resumes from the last committed one)", len(pending))
        for result in spool.results():
            spool.discard_result(result.entry)
            log.warning("an earlier run's spooled entry %s: %s%s", result.entry,
                        result.outcome.value,
                        f" as seq {result.seq}" if result.seq is not None else "")
        if not spool.uploader_alive(UPLOADER_MAX_AGE_S):
            log.warning("no uploader is running on the spool %s yet (`cairn sidecar --upload`): "
                        "snapshots reach the store only through it", spool.path)
        return cls(spool, account=account)

    def poll(self) -> None:
        """Take the uploader's verdicts: this run's go to ``account`` (a fence is also kept in
        :attr:`fenced`), an earlier run's are logged."""
        if self.epoch is None:
            return
        try:
            results = self.spool.results()
        except OSError as e:
            log.warning("cannot read the spool: %s", e)
            return
        for result in results:
            self.spool.discard_result(result.entry)
            if result.epoch != self.epoch:
                log.warning("an earlier run's spooled entry %s: %s", result.entry,
                            result.outcome.value)
                continue
            self._results[result.entry] = result
            if result.outcome is UploadOutcome.FENCED:
                self.fenced = result
            self._account(result)

    def busy(self, *, on_stalled: Callable[[str], None]) -> bool:
        """Whether a dump of this run still waits for the uploader (then the next periodic
        dump waits too: the shared volume holds one dump, and order matters).
        ``on_stalled`` hears, once per wait, that no uploader is running."""
        pending = self.spool.pending(self.epoch)
        if not pending:
            self._waiting = False
            return False
        if not self._waiting:
            self._waiting = True
            alive = self.spool.uploader_alive(UPLOADER_MAX_AGE_S)
            log.warning("the next snapshot waits: entry %s is not uploaded yet%s", pending[-1],
                        "" if alive else " and no uploader is running (cairn sidecar --upload)")
            if not alive:
                on_stalled("no uploader is running on the spool; spooled snapshots are not "
                           "reaching the store")
        return True

    def make_room(self, peak_bytes: int) -> None:
        """Before a final dump: withdraw this run's entries not yet uploaded when the volume
        cannot hold another dump of ``peak_bytes`` next to them (the final one supersedes
        them)."""
        pending = self.spool.pending(self.epoch)
        if not pending or not peak_bytes:
            return
        try:
            st = os.statvfs(self.spool.path)
        except OSError:
            return
        if st.f_bavail * st.f_frsize >= peak_bytes * 1.1:
            return
        for entry in pending:
            if self.spool.cancel(entry):
                self.spool.remove(entry)
                log.warning("withdrew spooled entry %s (not uploaded yet) to make room for the "
                            "final dump", entry)

    def withdraw_pending(self) -> None:
        """The step succeeded: its snapshots are about to be dropped, so entries not yet
        uploaded are cancelled instead of uploaded."""
        withdrawn = [e for e in self.spool.pending(self.epoch) if self.spool.cancel(e)]
        for entry in withdrawn:
            self.spool.remove(entry)
        if withdrawn:
            log.warning("cancelled %d spooled snapshot(s) not uploaded yet: the step is done",
                        len(withdrawn))

    def await_upload(self, entry: str, until: float) -> Result | None:
        """The uploader's verdict on ``entry``, waiting until ``until`` (monotonic)."""
        while True:
            self.poll()
            result = self._results.get(entry)
            if result is not None or time.monotonic() >= until:
                return result
            time.sleep(0.1)
