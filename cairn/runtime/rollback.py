"""Rollback refused (ADR 0049): each try records the newest snapshot seq it committed outside
the store, and a later try refuses to begin from an older one.

With encryption a bucket writer cannot forge a snapshot, but can still delete the newest ones
so that an older genuine one is restored: hours of training silently rolled back. The store
alone cannot tell (the deleted records are simply gone), so a place the bucket's writers do
not reach remembers how far the key had got: here a file on this machine, per store and key,
under :data:`~cairn.runtime.env.COMMITTED_DIR`. Where a try may move to another node, the
orchestrator's own place follows it: the integration copies the seq kept there into this
file before the try begins (``record(seq, source=...)``) and publishes the file's newest seq
back there while the try runs (:class:`MarkMirror`): Airflow's task state store, a Kubernetes
Job's annotation.

A try reads its mark before it opens its attempt (``Store.open_attempt(not_older_than=)``,
which raises :class:`~cairn.exceptions.RollbackRefused`) and records every commit after it.
:data:`~cairn.runtime.env.ALLOW_ROLLBACK` (``cairn run --allow-rollback``) lets it begin
from what the store offers; the next commit then moves the mark on from there.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import blake3

from cairn.exceptions import RollbackRefused, RollbackRefusedExit
from cairn.runtime.channel import write_json_atomic
from cairn.runtime.env import ALLOW_ROLLBACK, COMMITTED_DIR
from cairn.runtime.exits import ExitCode
from cairn.store import Key, Store
from cairn.store.url import canonical_url

log = logging.getLogger(__name__)

#: Only the user who ran the try reads its marks...
MARK_FILE_MODE = 0o600
#: ...but in a directory shared with a group (setgid: a pod's shared volume, whose marks its
#: sidecar, another user in the pod's group, publishes; :mod:`cairn.k8s.committed`), the
#: group reads and replaces them too.
SHARED_MARK_FILE_MODE = 0o660
#: `cairn run`'s option that allows a rollback (named in its refusals).
ROLLBACK_FLAG = "--allow-rollback"


@dataclass
class CommittedMark:
    """The newest seq committed for one store and key, in a JSON file at ``path``.

    :meth:`record` only ever moves it forward: after an allowed rollback the next commit
    takes a seq newer than any before it anyway. Thread-safe."""

    path: str
    store_url: str
    key: str
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def read(self) -> int | None:
        """The recorded seq; None when nothing was recorded (or the file is unreadable,
        which is logged: a mark that cannot be read protects nothing, but stops nothing)."""
        doc = self._document()
        return None if doc is None else doc["seq"]

    def record(self, seq: int, *, source: str | None = None) -> bool:
        """Remember that ``seq`` committed (durable when this returns); ``source``: where the
        seq was kept when it comes from another node's try (named in refusals). True when
        the mark moved."""
        with self._lock:
            current = self.read()
            if current is not None and current >= seq:
                return False
            self._write(seq, source)
            return True

    def _document(self) -> dict[str, Any] | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("cairn: ignoring the unreadable committed-seq record %s (%s)",
                        self.path, e)
            return None
        seq = doc.get("seq") if isinstance(doc, dict) else None
        if not isinstance(seq, int) or doc.get("key") != self.key \
                or doc.get("store") != self.store_url:
            log.warning("cairn: ignoring the committed-seq record %s: not this store's and "
                        "key's", self.path)
            return None
        return doc

    def _write(self, seq: int, source: str | None) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        doc: dict[str, Any] = {"store": self.store_url, "key": self.key, "seq": seq}
        if source:
            doc["source"] = source
        write_json_atomic(self.path, doc, mode=SHARED_MARK_FILE_MODE
                          if _group_shared(os.path.dirname(self.path)) else MARK_FILE_MODE)

    def where(self) -> str:
        doc = self._document()
        source = doc.get("source") if doc is not None else None
        return f"the file {self.path}" + (f", copied from {source}" if source else "")

    def entry(self, seq: int) -> dict[str, Any]:
        """What an orchestrator keeps for this mark: the store, the key and ``seq``."""
        return {"store": self.store_url, "key": self.key, "seq": seq}

    def seq_in(self, value: object) -> int | None:
        """The seq in ``value`` (an :meth:`entry` an orchestrator kept), or None when it is
        none of this store's and key's (a malformed one is logged)."""
        if value is None:
            return None
        if isinstance(value, dict) and value.get("store") == self.store_url \
                and value.get("key") == self.key and isinstance(value.get("seq"), int) \
                and not isinstance(value.get("seq"), bool):
            return value["seq"]
        log.warning("cairn: ignoring a kept committed seq that is not this store's and key's: "
                    "%.200r", value)
        return None


def _group_shared(directory: str) -> bool:
    try:
        return bool(os.stat(directory).st_mode & stat.S_ISGID)
    except OSError:
        return False


class KeptSeq(Protocol):
    """Where a seq is read from to be kept elsewhere: a :class:`CommittedMark`, or what an
    integration reads in its orchestrator's place (a pod's annotation)."""

    def read(self) -> int | None: ...

    def entry(self, seq: int) -> dict[str, Any]: ...


class MarkMirror(threading.Thread):
    """Publishes the newest seq ``mark`` records to an orchestrator's place (``publish(entry)``
    with :meth:`CommittedMark.entry`), polling the file every ``poll_s``: the commit path never
    waits on the orchestrator (an API server in an outage would stall it). A failed publish is
    logged once and tried again at the next poll; the newest seq wins. Only this thread
    calls ``publish`` until :meth:`stop` returns."""

    def __init__(self, mark: KeptSeq, publish: Callable[[dict[str, Any]], None], *,
                 published: int | None = None, poll_s: float = 1.0) -> None:
        super().__init__(name="cairn-mark-mirror", daemon=True)
        self.mark = mark
        self._publish = publish
        self.published = published
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self._failing = False

    def run(self) -> None:
        while not self._stopping.wait(self._poll_s):
            self.sync()
        self.sync()

    def sync(self) -> None:
        """Publish the mark's seq if it is newer than the last one published."""
        seq = self.mark.read()
        if seq is None or (self.published is not None and seq <= self.published):
            return
        try:
            self._publish(self.mark.entry(seq))
        except Exception as e:  # noqa: BLE001 - the next poll tries again
            if not self._failing:
                log.warning("cairn: could not keep committed seq %d outside the store (%s); "
                            "trying again", seq, e)
            self._failing = True
            return
        self._failing = False
        self.published = seq

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Publish what is left and stop; gives up waiting after ``timeout_s`` (the thread is
        a daemon: a publish blocked on an unreachable orchestrator does not hold the exit)."""
        self._stopping.set()
        if self.is_alive():
            self.join(timeout_s)
        if self.is_alive():
            log.warning("cairn: publishing committed seq %s outside the store did not finish "
                        "within %.0f s", self.mark.read(), timeout_s)


def local_mark(store_url: str, key: str,
               environ: Mapping[str, str] | None = None) -> CommittedMark:
    """This machine's mark for ``key`` in the store at ``store_url`` (any spelling of it:
    the mark is filed under the URL the opened store names itself by)."""
    store_url = canonical_url(store_url)
    base = os.path.expanduser(COMMITTED_DIR.get(environ) or "")
    # BLAKE3, which the store has loaded already: hashlib's import loads OpenSSL (~20 ms
    # from a cold disk, before a restore can begin).
    name = blake3.blake3(f"{store_url}\0{key}".encode()).hexdigest()[:32]
    return CommittedMark(path=os.path.join(base, f"{name}.json"), store_url=store_url, key=key)


def unkept_note(*, orchestrator: str) -> str:
    """The line a try prints where its orchestrator keeps nothing from one try to the next
    (KFP: a step's outputs exist only once it succeeds, and each retry is a new pod)."""
    return (f"cairn: {orchestrator} keeps nothing from one try of a step to the next, so a "
            f"retry in a new pod cannot tell whether newer snapshots were deleted from the "
            f"store behind its back, and restores the newest it finds; to refuse such a "
            f"rollback, mount a volume that every try of the step sees at {COMMITTED_DIR}")


def rollback_allowed(environ: Mapping[str, str] | None = None) -> bool:
    return (ALLOW_ROLLBACK.get(environ) or "").strip() == "1"


def refusal(error: RollbackRefused, mark: CommittedMark, *, flag: str | None = None) -> str:
    """The refusal's message with where the mark is kept and how to allow the rollback."""
    allow = f"{flag} or {ALLOW_ROLLBACK}=1" if flag else f"{ALLOW_ROLLBACK}=1"
    return (f"{error} (seq {error.recorded} is recorded in {mark.where()}). If restoring the "
            f"older snapshot is intended, run again with {allow}")


def oldest_allowed(mark: CommittedMark, *, allowed: bool, exclude: Collection[int] = ()) -> int | None:
    """The oldest seq a try may begin from: what ``mark`` recorded, unless the rollback is
    ``allowed`` or a resume policy passes over a seq at least that new (``exclude``)."""
    recorded = None if allowed else mark.read()
    if recorded is None or any(seq >= recorded for seq in exclude):
        return None
    return recorded


def open_attempt(store: Store, key: Key, mark: CommittedMark, *, floor: int | None,
                 flag: str | None = None, **options: Any) -> Any:
    """``store.open_attempt(key, **options)``, refusing to begin older than ``floor`` (what
    ``mark`` recorded; None: no check); the refusal names the mark and the way to allow it
    (``flag``: the command's option, if it has one)."""
    try:
        return store.open_attempt(key, not_older_than=floor, **options)
    except RollbackRefused as e:
        raise RollbackRefused(refusal(e, mark, flag=flag), recorded=e.recorded,
                              found=e.found) from None


def refuse_older(key: Key, seq: int | None, floor: int | None, mark: CommittedMark, *,
                 flag: str | None = None) -> None:
    """Raise :class:`RollbackRefused` when a restore that found the newer snapshots failing
    their checks would go on to ``seq`` (None: a fresh start), older than ``floor``."""
    if floor is not None and (seq is None or seq < floor):
        then = "nothing older verifies" if seq is None else f"the next is seq {seq}"
        error = RollbackRefused(f"key {key}: a try committed snapshot seq {floor}; the newer "
                                f"snapshots failed their checks (see the warnings above) and "
                                f"{then}: refusing to roll the work back",
                                recorded=floor, found=seq)
        raise RollbackRefused(refusal(error, mark, flag=flag), recorded=floor, found=seq)


@contextmanager
def exits_when_refused(logger: logging.Logger) -> Iterator[None]:
    """A :class:`RollbackRefused` raised in the block, logged at ERROR on ``logger`` and
    raised as the :class:`RollbackRefusedExit` (exit 9) that a bare script lets propagate:
    its orchestrator then tells a refusal, which every retry would repeat, from the step's
    own failure."""
    try:
        yield
    except RollbackRefusedExit:
        raise
    except RollbackRefused as e:
        logger.error("%s (exit %d)", e, ExitCode.ROLLBACK_REFUSED)
        raise RollbackRefusedExit(str(e), recorded=e.recorded, found=e.found,
                                  code=ExitCode.ROLLBACK_REFUSED) from None
