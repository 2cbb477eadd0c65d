"""The host work ``cairn run`` begins before the CLI's own imports (ADR 0039, amended).

The host checks (``criu --version``, ``criu check``: ~0.1 s of subprocesses here) used to start
once the CLI and the supervisor were imported (~0.17 s cold), and a restore waited for both in
turn. The ``cairn`` entry point (:mod:`cairn.cli.entry`) now calls :func:`begin` for a
``cairn run`` before it imports the CLI, so that the checks run beside those imports; the
supervisor :func:`take` s what was begun, or begins it then.

The order inside is the one ADR 0039 needs: ``/proc/sys`` made writable first (a mount
namespace of this process's own, which ``unshare`` refuses once a thread exists, and which
the checks must see), the checks' thread after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cairn.process import pids as pids_mod
from cairn.process.doctor import Preflight


@dataclass(frozen=True)
class HostStart:
    """What was begun: what making the PID cursor writable did (a sentence, or None when
    nothing was needed) or the error it met, and the host checks' thread (None when they were
    not asked for)."""

    cursor_note: str | None
    cursor_error: OSError | None
    preflight: Preflight | None

    @classmethod
    def now(cls, *, preflight: bool) -> HostStart:
        """Make the cursor writable, then start the checks. From the main thread, before any
        other thread starts (where another has, a read-only ``/proc/sys`` stays so: the error
        says why)."""
        try:
            note, error = pids_mod.make_cursor_writable(), None
        except OSError as e:
            note, error = None, e
        return cls(cursor_note=note, cursor_error=error,
                   preflight=Preflight() if preflight else None)


_begun: HostStart | None = None


def begin(*, preflight: bool) -> None:
    """Begin the host work now, for the supervisor to :func:`take` later (once per process;
    a second call does nothing)."""
    global _begun
    if _begun is None:
        _begun = HostStart.now(preflight=preflight)


def take(*, preflight: bool) -> HostStart:
    """What :func:`begin` began (once), or, if nothing was, the same begun now. Checks begun
    early are dropped when the run does not want them; checks wanted but not begun start
    here."""
    global _begun
    begun, _begun = _begun, None
    if begun is None:
        return HostStart.now(preflight=preflight)
    if preflight and begun.preflight is None:
        return HostStart(begun.cursor_note, begun.cursor_error, Preflight())
    if not preflight and begun.preflight is not None:
        return HostStart(begun.cursor_note, begun.cursor_error, None)
    return begun
