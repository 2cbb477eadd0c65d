"""The contracts both snapshot modes and every integration share, one home for each concept.

* :mod:`cairn.runtime.env` — the ``CAIRN_*`` environment contract (``docs/environment.md``);
* :mod:`cairn.runtime.exits` — exit codes and what each error and exit code stands for;
* :mod:`cairn.runtime.durations` — the one duration grammar (``30s``, ``10m``, ``1h``);
* :mod:`cairn.runtime.channel` — the notice and status files shared with the sidecar;
* :mod:`cairn.runtime.budget` — the final-snapshot budget;
* :mod:`cairn.runtime.interval` — the snapshot interval (Young–Daly);
* :mod:`cairn.runtime.endings` — how a try ended → its outcome record; marking a key done;
* :mod:`cairn.runtime.wakeup` — the wake-up pipe a signal handler may write.

Above :mod:`cairn.store`, below :mod:`cairn.process` and :mod:`cairn.state` (ADR 0018).
Importing any of them pulls in nothing heavy.
"""
