"""Exit codes, defined once: the CLI's, ``cairn run``'s, and what a step's exit code stands for.

====  ==============================================================
0     success
1     unexpected internal error (a bug: please report it)
2     bad usage or input (malformed URL, key, path or option)
3     not found: no store at the URL, no such key, seq or snapshot
4     verification failed: a snapshot is corrupt or incomplete
5     fenced: another attempt moved the key's log on
6     storage error: I/O, network or permission problem
7     ``doctor``: this host cannot run process mode (``--preflight``) or a check failed
8     restoring failed on this side (a library error, a bug, out of memory); no snapshot
      was skipped: fix the cause, then retry
75    preempted, a final snapshot was committed (retry to resume; ``EX_TEMPFAIL``)
76    preempted, no final snapshot (the previous one is kept)
77    suspended on request (``cairn suspend``); the final snapshot committed, or, logged,
      the previous one kept when the stopped workload's dump could not be stored
130   interrupted (Ctrl-C)
====  ==============================================================

``cairn run`` otherwise exits with its command's own code (128 + N if signal N killed it). The
same codes in both modes, so whatever reads a container's exit code (the Airflow operators,
Kubernetes, SLURM) maps them alike: :func:`error_for_exit` turns one back into the exception it
stands for. Stdlib and :mod:`cairn.exceptions` only.
"""

from __future__ import annotations

import enum
import os

from cairn.exceptions import (
    CairnError,
    ConfigError,
    CorruptSnapshot,
    Fenced,
    NotFound,
    Preempted,
    RestoreFailed,
    StoreError,
    Suspended,
)


class ExitCode(enum.IntEnum):
    """The documented exit codes (module docstring)."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    NOT_FOUND = 3
    CORRUPT = 4
    FENCED = 5
    STORAGE = 6
    NOT_READY = 7
    RESTORE_FAILED = 8
    PREEMPTED_SAVED = 75
    PREEMPTED_KEPT = 76
    SUSPENDED = 77
    INTERRUPTED = 130


PREEMPTED = frozenset({ExitCode.PREEMPTED_SAVED, ExitCode.PREEMPTED_KEPT})

_MEANING = {
    ExitCode.USAGE: "usage error",
    ExitCode.STORAGE: "the store is unreachable",
    ExitCode.NOT_READY: "this host cannot run process mode (run `cairn doctor --preflight`)",
    ExitCode.RESTORE_FAILED: ("restoring failed on this side (a library error, a bug, out of "
                              "memory); no snapshot was skipped: fix the cause, then retry"),
}


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
    if isinstance(error, CorruptSnapshot):
        return ExitCode.CORRUPT
    if isinstance(error, Fenced):
        return ExitCode.FENCED
    if isinstance(error, (StoreError, OSError)):
        return ExitCode.STORAGE
    return ExitCode.INTERNAL


def error_for_exit(code: int, *, key: object = None, where: str = "cairn run") -> CairnError | None:
    """The cairn error a step's exit ``code`` stands for: :class:`Preempted` for 75/76,
    :class:`Suspended` for 77, :class:`Fenced` for 5, :class:`RestoreFailed` for 8 (which
    an orchestrator fails without spending a retry); None for 0 and for every other code (the
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
                             f"{_MEANING[ExitCode.RESTORE_FAILED]} (its log names the cause)")
    return None


def describe_exit(code: int, *, where: str = "cairn run") -> str:
    """One line for a non-zero exit that is not a preemption or a fence."""
    if code in _MEANING:
        return f"{where} exited with {code}: {_MEANING[ExitCode(code)]}"
    return f"{where} exited with {code} (the command's own exit status, 128+N for signal N)"


def from_wait_status(status: int) -> int:
    """A ``waitpid`` status as a shell would report it: the exit code, or 128 + N for a
    process killed by signal N."""
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 1
