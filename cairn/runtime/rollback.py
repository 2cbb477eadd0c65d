"""Rollback refused (ADR 0049): each try records the newest snapshot seq it committed outside
the store, and a later try refuses to begin from an older one.

With encryption a bucket writer cannot forge a snapshot, but can still delete the newest ones
so that an older genuine one is restored: hours of training silently rolled back. The store
alone cannot tell (the deleted records are simply gone), so a place the bucket's writers do
not reach remembers how far the key had got: here a file on this machine, per store and key,
under :data:`~cairn.runtime.env.COMMITTED_DIR` (the orchestrators' own places, where they
have one, come through the same :class:`CommittedMark` interface).

A try reads its mark before it opens its attempt (``Store.open_attempt(not_older_than=)``,
which raises :class:`~cairn.exceptions.RollbackRefused`) and records every commit after it.
:data:`~cairn.runtime.env.ALLOW_ROLLBACK` (``cairn run --allow-rollback``) lets it begin
from what the store offers; the next commit then moves the mark on from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import RollbackRefused
from cairn.runtime.channel import write_json_atomic
from cairn.runtime.env import ALLOW_ROLLBACK, COMMITTED_DIR
from cairn.store import Key, Store

log = logging.getLogger(__name__)

#: Only the user who ran the try reads its marks.
MARK_FILE_MODE = 0o600
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
        return seq

    def record(self, seq: int) -> None:
        """Remember that ``seq`` committed (durable when this returns)."""
        with self._lock:
            current = self.read()
            if current is not None and current >= seq:
                return
            self._write(seq)

    def _write(self, seq: int) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        write_json_atomic(self.path, {"store": self.store_url, "key": self.key, "seq": seq},
                          mode=MARK_FILE_MODE)

    def where(self) -> str:
        return f"the file {self.path}"


def local_mark(store_url: str, key: str,
               environ: Mapping[str, str] | None = None) -> CommittedMark:
    """This machine's mark for ``key`` in the store at ``store_url``."""
    base = os.path.expanduser(COMMITTED_DIR.get(environ) or "")
    name = hashlib.sha256(f"{store_url}\0{key}".encode()).hexdigest()[:32]
    return CommittedMark(path=os.path.join(base, f"{name}.json"), store_url=store_url, key=key)


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
