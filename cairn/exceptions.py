"""The one exception hierarchy of cairn.

Every error cairn raises on purpose derives from :class:`CairnError`; each class maps to
one CLI exit code (see ``cairn.cli``) so scripts can branch on what went wrong.
"""

from __future__ import annotations


class CairnError(Exception):
    """Base class of every error cairn raises on purpose."""


class ConfigError(CairnError, ValueError):
    """Bad input from a user: a malformed URL, key, path or option. The message names the fix."""


class UnsupportedFilesystem(ConfigError):
    """The local store sits on a filesystem that cannot publish create-only (NFS, FUSE)."""


class StoreError(CairnError):
    """The store could not be read or written (I/O, network, permissions)."""


class StoreUnreachable(StoreError):
    """The first contact with the store, when a try starts, failed within its bound: the
    network, the server or the mount is not there. Nothing was read, so no try may begin (a
    fresh start would redo the work the store holds); the message names the store, what
    failed and the fix. ``reason`` is that failure in a few words (``connection refused``,
    ``timed out``...)."""

    def __init__(self, message: str, *, url: str, reason: str) -> None:
        super().__init__(message)
        self.url = url
        self.reason = reason


class AlreadyExists(StoreError):
    """A create-only write found the name taken. Inside the slot log this means *fenced*."""


class NotFound(StoreError):
    """A named object, key or snapshot does not exist."""


class PreconditionFailed(StoreError):
    """A conditional delete or update lost a race (the object changed since it was listed)."""


class Fenced(CairnError):
    """Another attempt has moved this key's log on; this writer must stop and never retry.

    Raised when creating the writer's next record conflicts. It is final for the attempt.
    """


class CorruptSnapshot(CairnError):
    """A snapshot failed verification (digest mismatch, missing or short chunk, bad manifest)."""

    def __init__(self, message: str, *, seq: int | None = None, digest: str | None = None) -> None:
        super().__init__(message)
        self.seq = seq
        self.digest = digest


class RollbackRefused(CairnError):
    """A try of this key committed snapshot ``recorded`` (as a place outside the store
    remembers), and the newest the store now offers is older (``found``; None for none): the
    newer ones were deleted behind the key's back or fail their checks. Restoring the older
    one would silently roll hours of work back, so the try does not begin; the caller names
    where ``recorded`` was kept and how to allow the rollback. Known only from an exit code
    (9, :mod:`cairn.runtime.exits`), ``recorded`` is None and the message says so."""

    def __init__(self, message: str, *, recorded: int | None, found: int | None) -> None:
        super().__init__(message)
        self.recorded = recorded
        self.found = found


class RollbackRefusedExit(RollbackRefused, SystemExit):
    """A :class:`RollbackRefused` raised where a bare script may let it propagate (the
    ``Checkpointer``'s ``restore``): also a :class:`SystemExit` whose ``code`` (``cairn
    run``'s 9, given by whoever raises it) is what the process exits with, instead of 1, so
    that an orchestrator tells a refusal, which every retry would repeat, from the step's own
    failure. Whoever raises it logs the message first."""

    def __init__(self, message: str, *, recorded: int | None, found: int | None,
                 code: int) -> None:
        super().__init__(message, recorded=recorded, found=found)
        self.code = code


class UnsafePath(CorruptSnapshot):
    """A snapshot names a path a restore will not write: outside the roots the restoring side
    configured, through a symlink, a device or another non-regular file, or a file with other
    hard links. A snapshot carrying one is not trusted: it is skipped like a corrupt one."""


class RestoreFailed(CairnError):
    """Reading or restoring a snapshot failed on the restoring side, not by a store verdict: a
    library error, a bug, out of memory. Unlike :class:`CorruptSnapshot` it says nothing about
    the snapshot, so nothing was skipped and every snapshot stays in place: fix the cause, then
    retry. ``seq`` is the snapshot being read, or None. Its ``__cause__`` is the failure."""

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


class RestoreFailedExit(RestoreFailed, SystemExit):
    """A :class:`RestoreFailed` raised where a bare script (``python train.py`` in a pod) may
    let it propagate: also a :class:`SystemExit` whose ``code`` (``cairn run``'s 8, from
    :mod:`cairn.runtime.exits`, given by whoever raises it) is what the process exits with,
    instead of 1. An uncaught SystemExit prints nothing: whoever raises it logs the cause
    first. ``except Exception`` still catches it."""

    def __init__(self, message: str, *, code: int, seq: int | None = None) -> None:
        super().__init__(message, seq=seq)
        self.code = code


class StoreUnreachableExit(StoreUnreachable, SystemExit):
    """A :class:`StoreUnreachable` raised where a bare script may let it propagate (the
    ``Checkpointer``'s constructor): also a :class:`SystemExit` whose ``code`` (``cairn
    run``'s 6 for a store it cannot reach, given by whoever raises it) is what the process
    exits with, instead of 1, so that a pod's or a batch script's exit code tells an outage
    from a bug. Whoever raises it logs the message first. ``except StoreUnreachable`` and
    ``except Exception`` still catch it."""

    def __init__(self, message: str, *, url: str, reason: str, code: int) -> None:
        super().__init__(message, url=url, reason=reason)
        self.code = code


class NoSnapshot(NotFound):
    """No committed snapshot that verifies exists for the key."""


class SnapshotTooSlow(StoreError):
    """A snapshot took longer than the store's GC grace allows; committing it could reference
    chunks that garbage collection may already have removed, so it is not committed."""


class Preempted(CairnError):
    """A preemption notice arrived; the final snapshot was committed if its cost fit the budget.

    ``seq`` is the final snapshot's seq, or None when it was skipped or failed.
    """

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


class PreemptedExit(Preempted, SystemExit):
    """A :class:`Preempted` raised where the signal's default action was installed before
    cairn's handler (a bare script: a pod, a SLURM job): also a :class:`SystemExit` whose
    ``code`` (``cairn run``'s preemption code, from :mod:`cairn.runtime.exits`, given by
    whoever raises it) is what the process exits with when nothing catches it, instead of dying
    by the signal before its orchestrator integration could record the outcome."""

    def __init__(self, message: str, *, code: int, seq: int | None = None) -> None:
        super().__init__(message, seq=seq)
        self.code = code


class Suspended(CairnError, SystemExit):
    """A suspend request was honoured: the final snapshot ``seq`` was committed and the try
    stops, to resume from it once a resume is asked for (``cairn resume``).

    Also a :class:`SystemExit` whose ``code`` is the suspended exit code
    (:mod:`cairn.runtime.exits`), given by whoever raises it: a script that lets it propagate
    exits with that code, which is how an unmodified ``python train.py`` tells its
    orchestrator "suspended" rather than "failed". ``except Exception`` still catches it.
    """

    def __init__(self, message: str, *, code: int, seq: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.seq = seq


class PartsMissing(StoreError):
    """A distributed snapshot cannot be committed yet: some ranks' parts are not there."""

    def __init__(self, message: str, *, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class ProcessError(CairnError):
    """Process mode could not snapshot or restore the workload (the workload itself is left
    as it was: running after a failed dump on CPU, not started after a failed restore)."""


class CriuFailed(ProcessError):
    """CRIU exited with an error; the message carries the tail of its log."""


class NotSnapshottable(ProcessError):
    """The workload holds something a snapshot cannot carry (the message names it and the
    fix): a file rewritten in place, an established TCP connection, unsupported GPU memory."""


class GaveUp(CairnError):
    """The resume policy says this step must not run again (it failed with its own error more
    than ``max_error_retries`` times): fix the step, then clear or rerun it."""
