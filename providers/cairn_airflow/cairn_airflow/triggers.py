"""``CairnResumeTrigger``: what a suspended cairn task waits on while it is deferred.

A cairn task whose step was suspended on request (``cairn suspend``, the snapshots page)
defers with this trigger instead of failing (see :mod:`cairn_airflow.suspend`), so its worker
slot, GPU or pod is free while it waits. The trigger runs in the triggerer, which in Airflow 3
has no metadata-database access: it reads only the cairn store, through cairn's store API
(``Store.records.suspension``: the key's request records, slot log and outcome records), every
``poll_seconds``, each read in a thread (``asyncio.to_thread``) so the triggerer's event loop
never blocks on the store.

It fires once, with one of these events (``event["status"]``):

- ``resumed``: a resume was asked for the suspended try (``by``, ``at``, ``reason``);
- ``released``: the key is no longer held for another reason (it was marked done or its
  snapshots discarded, or a newer suspension replaced this one); the continuation decides;
- ``resume_after``: the optional ``resume_after`` time (seconds since the Unix epoch) came
  first; the continuation asks for the resume itself, on the worker.

It never fires before ``not_before`` (seconds since the Unix epoch), which the operator sets
a little after the deferral: Airflow 3.3 fails a task into a retry when the continuation is
already queued under the same try number while the scheduler reads the deferred run's
"finished" event (see :data:`cairn_airflow.resume.MIN_RESCHEDULE_DELAY`).

A store that cannot be read is logged (once per outage) and polled again: an outage never
fires the trigger. For ``gs://`` stores the triggerer uses its own default credentials; an
encrypted store opens with the ``secret_file`` the task's connection named.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from cairn.exceptions import ConfigError

log = logging.getLogger(__name__)

CLASSPATH = "cairn_airflow.triggers.CairnResumeTrigger"


def look(store_url: str, key: str, epoch: int, *,
         secret_file: str | None = None) -> dict[str, Any] | None:
    """The event for ``key``'s suspension of try ``epoch`` as the store has it now, or None
    while it is still held. Blocking (reads the store, encrypted with the secret in
    ``secret_file`` when given, else as this process's environment says); raises what the
    store raises."""
    from cairn.runtime.env import SECRET_FILE
    from cairn.runtime.stores import open_store
    from cairn.store import Key, format_timestamp

    # Passed, not put in os.environ: the triggerer runs many triggers in one process.
    environ = {**os.environ, SECRET_FILE.name: secret_file} if secret_file else None
    with open_store(store_url, create=False, environ=environ) as store:
        current = store.records.suspension(Key.parse(key))
    if current is None:
        return {"status": "released", "epoch": epoch,
                "reason": "the key is no longer suspended (it was marked done or discarded)"}
    if current.suspend.epoch != epoch:
        return {"status": "released", "epoch": epoch,
                "reason": f"a newer suspension (of try {current.suspend.epoch}) replaced it"}
    if current.resume is None:
        return None
    r = current.resume
    return {"status": "resumed", "epoch": epoch, "by": r.by, "at": format_timestamp(r.at),
            "reason": r.reason}


class CairnResumeTrigger(BaseTrigger):
    """Fires when try ``epoch`` of ``key`` (its text form) in the store at ``store_url`` may
    resume (see the module docstring).

    :param resume_after: seconds since the Unix epoch after which the task resumes even
        without a resume request (None: only on request).
    :param poll_seconds: time between two looks at the store (> 0).
    :param not_before: seconds since the Unix epoch before which it does not fire.
    :param secret_file: an encrypted store's secret file (a path, never the secret: trigger
        arguments are stored in the metadata DB), as the task's connection named it; it must
        exist on the triggerer's host too (a mounted secret, or the same host).
    """

    def __init__(self, *, store_url: str, key: str, epoch: int,
                 resume_after: float | None = None, poll_seconds: float = 5.0,
                 not_before: float | None = None, secret_file: str | None = None) -> None:
        super().__init__()
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
            raise ConfigError(f"epoch must be a try's epoch (an integer >= 1), got {epoch!r}")
        if not poll_seconds > 0:
            raise ConfigError(f"poll_seconds must be positive, got {poll_seconds!r}")
        self.store_url = store_url
        self.key = key
        self.epoch = epoch
        self.resume_after = None if resume_after is None else float(resume_after)
        self.poll_seconds = float(poll_seconds)
        self.not_before = None if not_before is None else float(not_before)
        self.secret_file = secret_file

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {"store_url": self.store_url, "key": self.key, "epoch": self.epoch,
                           "resume_after": self.resume_after,
                           "poll_seconds": self.poll_seconds, "not_before": self.not_before,
                           "secret_file": self.secret_file}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in self._wait():
            if self.not_before is not None and (early := self.not_before - time.time()) > 0:
                await asyncio.sleep(early)
            yield event
            return

    async def _wait(self) -> AsyncIterator[TriggerEvent]:
        failing = False
        while True:
            try:
                event = await asyncio.to_thread(look, self.store_url, self.key, self.epoch,
                                                secret_file=self.secret_file)
                failing = False
            except Exception as e:  # noqa: BLE001 - an outage must not fire the trigger
                if not failing:
                    log.warning("cairn: cannot read the store for %s's resume (%s); trying "
                                "again every %.1fs", self.key, e, self.poll_seconds)
                failing, event = True, None
            if event is not None:
                yield TriggerEvent(event)
                return
            wait = self.poll_seconds
            if self.resume_after is not None:
                left = self.resume_after - time.time()
                if left <= 0:
                    yield TriggerEvent({"status": "resume_after", "epoch": self.epoch,
                                        "at": self.resume_after})
                    return
                wait = min(wait, left)
            await asyncio.sleep(wait)
