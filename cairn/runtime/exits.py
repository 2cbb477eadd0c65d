"""Exit codes, defined once: the CLI's, ``cairn run``'s, and what a step's exit code stands for.

:class:`ExitCode` names them and :data:`MEANINGS` says what each means (the CLI's help prints
that table: :func:`describe_exit_codes`); :data:`RUN_CODES` are the ones ``cairn run`` exits
with itself, any other being its command's own (128 + N if signal N killed it). The same codes
in both modes, so whatever reads a container's exit code (the Airflow operators, Kubernetes,
SLURM) maps them alike: :func:`error_for_exit` turns one back into the exception it stands
for. Elsewhere, refer to this module rather than retyping the table. Stdlib and
:mod:`cairn.exceptions` only.
"""

from __future__ import annotations

import enum
import os
import textwrap
from collections.abc import Iterable

from cairn.exceptions import (
    CairnError,
    ConfigError,
    CorruptSnapshot,
    Fenced,
    NotFound,
    Preempted,
    RestoreFailed,
    RollbackRefused,
    StoreError,
    Suspended,
)


class ExitCode(enum.IntEnum):
    """The documented exit codes (what each means: :data:`MEANINGS`)."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    NOT_FOUND = 3
    CORRUPT = 4
    FENCED = 5
    STORAGE = 6
    NOT_READY = 7
    RESTORE_FAILED = 8
    ROLLBACK_REFUSED = 9
    PREEMPTED_SAVED = 75
    PREEMPTED_KEPT = 76
    SUSPENDED = 77
    INTERRUPTED = 130


PREEMPTED = frozenset({ExitCode.PREEMPTED_SAVED, ExitCode.PREEMPTED_KEPT})

#: What each code means, for every command: the one table (``cairn --help`` prints it).
MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.INTERNAL: "unexpected internal error (a bug: please report it)",
    ExitCode.USAGE: "bad usage or input (malformed URL, key, path or option)",
    ExitCode.NOT_FOUND: "not found: no store at the URL, no such key, seq or snapshot",
    ExitCode.CORRUPT: "verification failed: a snapshot is corrupt or incomplete",
    ExitCode.FENCED: "fenced: a newer attempt took the key's log over (cairn run stops its "
                     "command)",
    ExitCode.STORAGE: "storage error: the store could not be opened, read or written (I/O, "
                      "network or permission)",
    ExitCode.NOT_READY: "this host cannot run process mode (run `cairn doctor --preflight`), or "
                        "a `cairn doctor` check failed",
    ExitCode.RESTORE_FAILED: "restoring failed on this side (a library error, a bug, out of "
                             "memory; cairn run's command was not started or, restored lazily, "
                             "was stopped); no snapshot was skipped: fix the cause, then retry",
    ExitCode.ROLLBACK_REFUSED: "rollback refused: a try of the key committed a newer snapshot "
                               "than the store now offers (deleted behind its back, or failing "
                               "its checks); nothing was restored or started, and a retry would "
                               "refuse the same: find out what happened to the store, then allow "
                               "it with --allow-rollback or CAIRN_ALLOW_ROLLBACK=1",
    ExitCode.PREEMPTED_SAVED: "preempted (SIGTERM/SIGINT) and a final snapshot was committed "
                              "(with --spool: or handed to the sidecar, still uploading when "
                              "the budget ran out); a retry resumes from it (EX_TEMPFAIL)",
    ExitCode.PREEMPTED_KEPT: "preempted and no final snapshot (it would not fit --grace, or it "
                             "failed; the previous one is kept)",
    ExitCode.SUSPENDED: "suspended on request (`cairn suspend`) with a final snapshot committed "
                        "(or, logged, the previous one kept when the stopped workload's dump "
                        "could not be stored), or the key is suspended and the command was not "
                        "started (`cairn resume` lifts it)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}

#: The codes ``cairn run`` exits with itself; any other is its command's own (:data:`OWN_CODE`).
RUN_CODES: tuple[ExitCode, ...] = (
    ExitCode.USAGE, ExitCode.FENCED, ExitCode.STORAGE, ExitCode.NOT_READY,
    ExitCode.RESTORE_FAILED, ExitCode.ROLLBACK_REFUSED, ExitCode.PREEMPTED_SAVED,
    ExitCode.PREEMPTED_KEPT, ExitCode.SUSPENDED)

#: Only ``cairn run`` exits with these.
RUN_ONLY = PREEMPTED | {ExitCode.SUSPENDED}

OWN_CODE = "the command's own exit status (128+N when signal N killed it)"


def describe_exit_codes(codes: Iterable[ExitCode] = tuple(ExitCode), *, width: int = 79) -> str:
    """A table of ``codes`` and their :data:`MEANINGS`, one code a row, wrapped at ``width``
    (for help text printed as it is: argparse's ``RawDescriptionHelpFormatter``)."""
    rows = []
    for code in codes:
        rows.append(textwrap.fill(MEANINGS[code], width, initial_indent=f"  {int(code):<5}",
                                  subsequent_indent=" " * 7))
    return "\n".join(rows)


def preempted_code(seq: int | None) -> ExitCode:
    """A preemption's exit code: 75 when ``seq`` names the committed final snapshot, else 76."""
    return ExitCode.PREEMPTED_SAVED if seq is not None else ExitCode.PREEMPTED_KEPT


def exit_code_for(error: BaseException) -> ExitCode:
    """The exit code a command ending with ``error`` reports (a preemption: 75 when its
    ``seq`` names the committed final snapshot, else 76)."""
    if isinstance(error, Suspended):
        return ExitCode.SUSPENDED
    if isinstance(error, Preempted):
        return preempted_code(error.seq)
    if isinstance(error, ConfigError):
        return ExitCode.USAGE
    if isinstance(error, NotFound):
        return ExitCode.NOT_FOUND
    if isinstance(error, RestoreFailed):
        return ExitCode.RESTORE_FAILED
    if isinstance(error, RollbackRefused):
        return ExitCode.ROLLBACK_REFUSED
    if isinstance(error, CorruptSnapshot):
        return ExitCode.CORRUPT
    if isinstance(error, Fenced):
        return ExitCode.FENCED
    if isinstance(error, (StoreError, OSError)):
        return ExitCode.STORAGE
    return ExitCode.INTERNAL


def error_for_exit(code: int, *, key: object = None, where: str = "cairn run") -> CairnError | None:
    """The cairn error a step's exit ``code`` stands for: :class:`Preempted` for 75/76,
    :class:`Suspended` for 77, :class:`Fenced` for 5, :class:`RestoreFailed` for 8 and
    :class:`RollbackRefused` for 9 (both of which an orchestrator fails without spending a
    retry); None for 0 and for every other code (the
    step's own failure, or a usage, storage or host error: see :func:`describe_exit`)."""
    if code == ExitCode.SUSPENDED:
        return Suspended(f"{where} was suspended on request (exit {code}); its final snapshot "
                         "was committed; it resumes from it once `cairn resume` is asked for",
                         code=int(ExitCode.SUSPENDED))
    if code in PREEMPTED:
        saved = ("committed" if code == ExitCode.PREEMPTED_SAVED
                 else "not taken (the previous one is kept)")
        return Preempted(f"{where} was stopped (exit {code}); its final snapshot was {saved}; a "
                         "retry resumes from the last committed snapshot")
    if code == ExitCode.FENCED:
        whose = f" of {key}" if key is not None else ""
        return Fenced(f"a newer try{whose} took the key over; {where} stopped its workload "
                      f"(exit {code})")
    if code == ExitCode.RESTORE_FAILED:
        return RestoreFailed(f"{where} could not restore its snapshot (exit {code}): "
                             f"{MEANINGS[ExitCode.RESTORE_FAILED]} (its log names the cause)")
    if code == ExitCode.ROLLBACK_REFUSED:
        whose = f" of {key}" if key is not None else ""
        return RollbackRefused(f"{where} refused to begin the try{whose} (exit {code}): "
                               f"{MEANINGS[ExitCode.ROLLBACK_REFUSED]} (its log names both "
                               "seqs and where the newer one was kept)",
                               recorded=None, found=None)
    return None


def describe_exit(code: int, *, where: str = "cairn run") -> str:
    """One line for a non-zero exit of ``cairn run`` (:data:`RUN_CODES`, else the command's
    own)."""
    if code in RUN_CODES:
        return f"{where} exited with {code}: {MEANINGS[ExitCode(code)]}"
    return f"{where} exited with {code} ({OWN_CODE})"


def from_wait_status(status: int) -> int:
    """A ``waitpid`` status as a shell would report it: the exit code, or 128 + N for a
    process killed by signal N."""
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 1
