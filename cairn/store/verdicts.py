"""Which failures while reading a snapshot are the store's verdict on it, and which are the
restoring side's own: the one classifier every restore loop uses.

A restore skips to an older snapshot only on a verdict about the snapshot itself:
:class:`~cairn.exceptions.CorruptSnapshot` and its subclasses (a missing object or chunk, a
digest mismatch, a failed authentication, ``SealBroken``; a manifest or record that cairn's
own parser refuses; ``UnsafePath``). Every other :class:`~cairn.exceptions.CairnError`
(``StoreError``, ``CriuFailed``...) and ``OSError`` (the store's or this host's I/O, which the
callers and the exit codes already treat as such) pass through unchanged and skip nothing
either. Any other exception (a library error such as cryptography's ``ValueError``, a bug,
``MemoryError``) becomes :class:`~cairn.exceptions.RestoreFailed` naming it, with it as the
cause: the try ends, nothing is skipped and every snapshot stays in place.

Hence the rule for code that reads a snapshot: a ``try`` that turns ``ValueError``/``KeyError``/
``TypeError`` into ``CorruptSnapshot`` wraps only cairn's own parsing of bytes already read,
never the read itself nor a library call that is not a parser of store data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from cairn.exceptions import CairnError, RestoreFailed, RestoreFailedExit


def as_read_failure(error: BaseException, *, seq: int | None) -> BaseException:
    """``error`` itself when it is a store verdict, another CairnError, an OSError or not an
    Exception (KeyboardInterrupt, SystemExit); otherwise a new :class:`RestoreFailed` for
    snapshot ``seq`` naming it, with ``error`` as its ``__cause__``."""
    if not isinstance(error, Exception) or isinstance(error, (CairnError, OSError)):
        return error
    where = f"snapshot seq {seq}" if seq is not None else "a snapshot"
    failure = RestoreFailed(
        f"reading {where} failed on this side, not by a store verdict: "
        f"{type(error).__name__}: {error}; no snapshot was skipped and every snapshot stays "
        "in place: fix the cause, then retry", seq=seq)
    failure.__cause__ = error
    return failure


@contextmanager
def reading(seq: int | None) -> Iterator[None]:
    """Run a read of snapshot ``seq``: what escapes is classified by :func:`as_read_failure`
    (a verdict or an I/O error unchanged, anything else as :class:`RestoreFailed`)."""
    try:
        yield
    except Exception as error:
        failure = as_read_failure(error, seq=seq)
        if failure is error:
            raise
        raise failure from error


def restore_failed_exit(failure: RestoreFailed, *, code: int,
                        logger: logging.Logger) -> RestoreFailedExit:
    """``failure`` as a :class:`RestoreFailedExit` with exit ``code`` (same message, seq and
    cause), logged first on ``logger`` at ERROR with its cause's traceback: a bare script that
    lets the exit propagate prints nothing else."""
    cause = failure.__cause__
    logger.error("%s", failure, exc_info=cause if cause is not None else failure)
    exit_error = RestoreFailedExit(str(failure), code=code, seq=failure.seq)
    exit_error.__cause__ = cause
    return exit_error
