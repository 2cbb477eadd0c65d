"""``cairn sidecar --upload``: commit the supervisor's spooled dumps to the store.

A thread of the sidecar polls the spool (:mod:`cairn.process.spool`) on the volume it shares
with the main container. It takes the oldest complete entry, commits it as the next snapshot
of the attempt that dumped it (:func:`cairn.process.spool.upload`), leaves the verdict as
``<entry>.result.json`` for the supervisor and deletes the entry. Rules:

* strictly in order: a failed upload is retried with backoff (1 s doubling to a minute) and
  blocks the younger entries, since a ``snap`` committed later must never hold an older state;
  an entry with a younger complete entry of the same attempt behind it is *superseded*
  (dropped unsent), so a final dump never waits behind a stale periodic one;
* a fenced entry (a newer attempt opened the key) can never be committed: dropped, logged,
  and counted in ``cairn_sidecar_uploads_dropped_total{reason="fenced"}``;
* on SIGTERM the sidecar keeps uploading until the spool is empty or its window runs out
  (native sidecars are stopped after the main container exits, within the pod's grace);
* each commit is handed to ``on_commit`` (the sidecar records it as the newest committed seq,
  ADR 0049) before its verdict is written, so the supervisor, recording it in turn, finds it
  recorded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cairn.exceptions import CairnError, ConfigError

log = logging.getLogger("cairn.sidecar.upload")

MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
HEARTBEAT_S = 2.0  # the supervisor deems the uploader gone after a few missed beats
# The sidecar's memory is small (transform.py): fewer, smaller packs in flight than a
# supervisor would use.
UPLOAD_PACK_BYTES = 16 << 20
UPLOAD_INFLIGHT_PACKS = 2
UPLOAD_IO_THREADS = 4


@dataclass(frozen=True)
class UploadSettings:
    spool_dir: str
    store: str | None = None  # None: each ticket's own store URL
    key: str | None = None  # given: tickets for another key are refused
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if self.key is not None:
            from cairn.store import Key

            Key.parse(self.key)


@dataclass(frozen=True)
class UploadStats:
    """Cumulative for this sidecar process (a restart starts them from zero)."""

    committed: int = 0
    failures: int = 0  # upload tries that failed and will be retried
    dropped: dict[str, int] = field(default_factory=dict)  # entries never committed, by reason
    bytes_written: int = 0
    seconds: float = 0.0
    pending: int = 0
    last_seq: int | None = None
    last_success_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None


class Uploader:
    """Construct, :meth:`start`, and at the end :meth:`drain` then :meth:`stop`. :meth:`step`
    does one pass (the thread calls it in a loop; tests call it directly)."""

    def __init__(self, settings: UploadSettings, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_commit: Callable[[str, str, int], None] | None = None) -> None:
        """``on_commit(store_url, key, seq)``: called from the upload thread for each commit,
        before the supervisor can learn of it; it must not raise."""
        from cairn.process.spool import Spool

        self.settings = settings
        self._on_commit = on_commit
        self._clock = clock  # for the retry backoff
        self.spool = Spool(settings.spool_dir)
        self._stats = UploadStats()
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._stores: dict[str, Any] = {}
        self._retry_at: dict[str, float] = {}
        self._tries: dict[str, int] = {}
        # Each key's page-delta state from its last commit, handed to the next (upload thread
        # only): without it every spooled dump's changed chunks would be stored whole.
        self._deltas: dict[tuple[str, ...], Any] = {}
        self._key = None if settings.key is None else _components(settings.key)
        self._beat: threading.Thread | None = None

    @property
    def stats(self) -> UploadStats:
        with self._lock:
            return replace(self._stats, dropped=dict(self._stats.dropped))

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._stats = replace(self._stats, **changes)

    def _drop(self, reason: str, error: str | None = None) -> None:
        with self._lock:
            dropped = dict(self._stats.dropped)
            dropped[reason] = dropped.get(reason, 0) + 1
            changes: dict[str, Any] = {"dropped": dropped}
            if error is not None:
                changes.update(last_error=error[:500], last_error_at=time.time())
            self._stats = replace(self._stats, **changes)

    # -- one pass --------------------------------------------------------------------------

    def _store(self, url: str) -> Any:
        store = self._stores.get(url)
        if store is None:
            from cairn.runtime.stores import open_store
            from cairn.store import StoreSettings

            store = open_store(url, create=False, settings=StoreSettings(
                pack_bytes=UPLOAD_PACK_BYTES, max_inflight_packs=UPLOAD_INFLIGHT_PACKS,
                io_threads=UPLOAD_IO_THREADS))
            self._stores[url] = store
        return store

    def _heartbeat(self) -> None:
        st = self.stats
        try:
            self.spool.write_heartbeat({"pid": os.getpid(), "pending": st.pending,
                                        "committed": st.committed, "last_seq": st.last_seq,
                                        "last_error": st.last_error})
        except OSError as e:
            log.debug("cannot write the heartbeat: %s", e)

    def _finish(self, result: Any, *, ticket: Any = None) -> None:
        """Leave the verdict for the supervisor, then delete the entry."""
        from cairn.process.spool import UploadOutcome

        self.spool.write_result(result)
        self.spool.remove(result.entry)
        self._retry_at.pop(result.entry, None)
        self._tries.pop(result.entry, None)
        if result.outcome is UploadOutcome.COMMITTED:
            st = self.stats
            self._update(committed=st.committed + 1,
                         bytes_written=st.bytes_written + result.bytes_written,
                         seconds=st.seconds + result.upload_s, last_seq=result.seq,
                         last_success_at=time.time())
            log.warning("entry %s committed as seq %s: wrote %.1f MB of %.1f MB in %.2fs%s",
                        result.entry, result.seq, result.bytes_written / 1e6,
                        result.image_bytes / 1e6, result.upload_s,
                        f" ({result.detail})" if result.detail else "")
        elif result.outcome in (UploadOutcome.FENCED, UploadOutcome.INVALID):
            self._drop(result.outcome.value, f"entry {result.entry}: {result.detail}")
            log.error("dropped entry %s (%s): %s", result.entry, result.outcome.value,
                      result.detail)
        else:
            self._drop(result.outcome.value)
            log.warning("dropped entry %s (%s): %s", result.entry, result.outcome.value,
                        result.detail)

    def step(self) -> bool:
        """Handle at most one entry; whether anything was done (else the caller waits)."""
        from cairn.process.spool import UploadOutcome, Result, parse_entry, upload

        spool = self.spool
        complete: list[tuple[str, Any]] = []
        for entry in spool.entries():
            if spool.is_complete(entry):
                try:
                    ticket = spool.read_ticket(entry)
                except ConfigError as e:
                    self._finish(Result(entry, UploadOutcome.INVALID, parse_entry(entry)[0],  # type: ignore[index]
                                        detail=str(e)))
                    return True
                if ticket is None:  # cancelled between the two looks
                    continue
                if self._key is not None and ticket.key != self._key:
                    self._finish(Result(entry, UploadOutcome.INVALID, ticket.epoch,
                                        detail=f"its key {'/'.join(ticket.key)} is not this "
                                               f"sidecar's --key {self.settings.key}"))
                    return True
                complete.append((entry, ticket))
            elif spool.is_cancelled(entry):
                spool.remove(entry)  # withdrawn before it was taken; free the space
        self._update(pending=len(complete))
        if not complete:
            return False
        entry, ticket = complete[0]
        newer = [e for e, t in complete[1:] if (t.key, t.epoch) == (ticket.key, ticket.epoch)]
        if newer:
            self._finish(Result(entry, UploadOutcome.SUPERSEDED, ticket.epoch,
                                detail=f"entry {newer[-1]} is newer"))
            return True
        if self._clock() < self._retry_at.get(entry, 0.0):
            return False
        url = self.settings.store or ticket.store
        try:
            result = upload(self._store(url), spool, ticket, deltas=self._deltas)
        except (CairnError, OSError) as e:
            if not spool.is_complete(entry):
                self._finish(Result(entry, UploadOutcome.CANCELLED, ticket.epoch,
                                    detail=f"withdrawn during the upload ({e})"))
                return True
            tries = self._tries.get(entry, 0) + 1
            self._tries[entry] = tries
            delay = min(MAX_BACKOFF_S, MIN_BACKOFF_S * 2 ** (tries - 1))
            self._retry_at[entry] = self._clock() + delay
            st = self.stats
            self._update(failures=st.failures + 1, last_error=f"entry {entry}: {e}"[:500],
                         last_error_at=time.time())
            log.error("uploading entry %s to %s failed (try %d; next in %.0fs): %s", entry,
                      url, tries, delay, e)
            return False
        if self._on_commit is not None and result.outcome is UploadOutcome.COMMITTED \
                and result.seq is not None:
            from cairn.store import Key

            self._on_commit(self._store(url).url, str(Key(ticket.key)), result.seq)
        self._finish(result, ticket=ticket)
        return True

    # -- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._halt.is_set():
            try:
                did = self.step()
            except Exception as e:  # noqa: BLE001 - the thread must not die silently
                log.exception("uploader pass failed: %s", e)
                self._update(last_error=str(e)[:500], last_error_at=time.time())
                did = False
            if not did:
                self._halt.wait(self.settings.poll_s)

    def _beat_loop(self) -> None:
        # Its own thread: a long upload must not make the uploader look dead to the supervisor.
        while not self._halt.is_set():
            self._heartbeat()
            self._halt.wait(HEARTBEAT_S)

    def start(self) -> None:
        self.spool.ensure()
        self.spool.sweep_trash()
        self._heartbeat()
        self._beat = threading.Thread(target=self._beat_loop, name="cairn-uploader-beat",
                                      daemon=True)
        self._beat.start()
        self._thread = threading.Thread(target=self._loop, name="cairn-uploader", daemon=True)
        self._thread.start()
        log.warning("uploading from %s to %s", self.spool.path,
                    self.settings.store or "each ticket's store")

    def pending(self) -> int:
        return len(self.spool.pending())

    def drain(self, timeout_s: float) -> int:
        """Keep uploading until no complete entry is left or ``timeout_s`` passes; returns how
        many are left."""
        deadline = time.monotonic() + timeout_s
        left = self.pending()
        if left:
            log.warning("stopping: %d spooled snapshot(s) left to upload; waiting up to %.0fs",
                        left, timeout_s)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.pending()
        if left:
            log.error("stopping with %d spooled snapshot(s) not uploaded (the window ran out); "
                      "the retry resumes from the last committed one", left)
        return left

    def stop(self) -> None:
        self._halt.set()
        for thread in (self._thread, self._beat):
            if thread is not None:
                thread.join(timeout=5)
        for store in self._stores.values():
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass
        self._stores.clear()


def _components(key: str) -> tuple[str, ...]:
    from cairn.store import Key

    return Key.parse(key).components
