"""How a try ends, decided in one place for both snapshot modes and the pod operator: the first
part of the try session (ADR 0043).

A try ends in one of the ways of :class:`Ending`. Each caller reads its own signals into a
:class:`TryEnd` — the state mode from the exception its loop ended with (:func:`end_of_error`),
``cairn run`` from the code its supervisor exits with (:func:`end_of_exit`), the pod operator
from a pod the node or the kernel ended (:func:`end_of_pod`) — and :func:`conclude` alone maps
a ``TryEnd`` to the exit code the try's process reports and the outcome its record holds. A
preemption whose pod's Job was suspended (a Kueue eviction, ADR 0028) is a suspension, for
every mode: :func:`after_cause`. No I/O here; stdlib, the runtime's exit codes and the store's
outcome kinds only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from cairn.exceptions import Fenced, Preempted, RestoreFailed, RollbackRefused, Suspended
from cairn.runtime.channel import Cause
from cairn.runtime.exits import ExitCode
from cairn.store.outcomes import OutcomeKind


class Ending(str, enum.Enum):
    """How a try ended, whatever its mode."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the step's own error (or the supervisor's)
    PREEMPTED = "preempted"  # stopped by a signal or notice, or by the node
    SUSPENDED = "suspended"  # a suspend request honoured, or its pod's Job suspended
    FENCED = "fenced"  # a newer try took the key over
    RESTORE_FAILED = "restore_failed"  # reading a snapshot failed on this side (ADR 0037)


@dataclass(frozen=True, kw_only=True)
class TryEnd:
    """One try's end. ``saved``: a final snapshot was committed (a preemption or suspension);
    ``evicted``: the platform moved the workload away on purpose (a maintenance notice, a
    drain), not a failure of the capacity; ``code``: a failed step's own exit code, when it
    has one (``cairn run``'s command; a state-mode script exits as Python does)."""

    ending: Ending
    saved: bool = False
    evicted: bool = False
    code: int | None = None


@dataclass(frozen=True)
class Conclusion:
    """What a try's end comes to: ``exit_code`` the try's process exits with (None: as Python
    does, for a state-mode step's own error) and ``outcome`` its outcome record holds."""

    exit_code: int | None
    outcome: OutcomeKind


def conclude(end: TryEnd) -> Conclusion:
    """The exit code and the outcome of ``end``: the one mapping (module docstring)."""
    if end.ending is Ending.SUCCEEDED:
        return Conclusion(ExitCode.OK, OutcomeKind.SUCCEEDED)
    if end.ending is Ending.PREEMPTED:
        return Conclusion(ExitCode.PREEMPTED_SAVED if end.saved else ExitCode.PREEMPTED_KEPT,
                          OutcomeKind.EVICTED if end.evicted else OutcomeKind.PREEMPTED)
    if end.ending is Ending.SUSPENDED:
        return Conclusion(ExitCode.SUSPENDED, OutcomeKind.SUSPENDED)
    if end.ending is Ending.FENCED:
        return Conclusion(ExitCode.FENCED, OutcomeKind.FENCED)
    if end.ending is Ending.RESTORE_FAILED:
        return Conclusion(ExitCode.RESTORE_FAILED, OutcomeKind.FAILED)
    return Conclusion(end.code, OutcomeKind.FAILED)


def end_of_error(error: BaseException | None) -> TryEnd:
    """The end of a try whose loop ended with ``error`` (None: it succeeded)."""
    if error is None:
        return TryEnd(ending=Ending.SUCCEEDED)
    if isinstance(error, Suspended):
        return TryEnd(ending=Ending.SUSPENDED, saved=error.seq is not None)
    if isinstance(error, Preempted):
        return TryEnd(ending=Ending.PREEMPTED, saved=error.seq is not None)
    if isinstance(error, Fenced):
        return TryEnd(ending=Ending.FENCED)
    if isinstance(error, RestoreFailed):
        return TryEnd(ending=Ending.RESTORE_FAILED)
    if isinstance(error, RollbackRefused):  # the try's own failure, with a code of its own
        return TryEnd(ending=Ending.FAILED, code=ExitCode.ROLLBACK_REFUSED)
    return TryEnd(ending=Ending.FAILED)


def end_of_exit(code: int | None, *, maintenance: bool = False) -> TryEnd:
    """The end of a try whose supervisor exited with ``code`` (None: the supervisor itself
    failed); a preemption announced as maintenance was an eviction. The inverse of
    :func:`conclude`'s exit codes."""
    if code == ExitCode.OK:
        return TryEnd(ending=Ending.SUCCEEDED)
    if code in (ExitCode.PREEMPTED_SAVED, ExitCode.PREEMPTED_KEPT):
        return TryEnd(ending=Ending.PREEMPTED, saved=code == ExitCode.PREEMPTED_SAVED,
                      evicted=maintenance)
    if code == ExitCode.SUSPENDED:
        return TryEnd(ending=Ending.SUSPENDED)
    if code == ExitCode.FENCED:
        return TryEnd(ending=Ending.FENCED)
    if code == ExitCode.RESTORE_FAILED:
        return TryEnd(ending=Ending.RESTORE_FAILED)
    return TryEnd(ending=Ending.FAILED, code=code)


def end_of_pod(*, oom_killed: bool, drained: bool, node_ended: bool) -> TryEnd | None:
    """The end of a try whose pod ended without its supervisor reporting it: the step's own
    failure for an OOM kill, an eviction for a drain (eviction API, pod GC, node-pressure
    eviction), a preemption for a node shutdown or scheduler preemption; None when nothing is
    known."""
    if oom_killed:
        return TryEnd(ending=Ending.FAILED)
    if drained:
        return TryEnd(ending=Ending.PREEMPTED, evicted=True)
    if node_ended:
        return TryEnd(ending=Ending.PREEMPTED)
    return None


def after_cause(end: TryEnd, cause: Cause | None) -> TryEnd:
    """``end`` once the pod's sidecar said why the pod is stopping: a preemption whose Job was
    suspended (``cause.suspended``) is a suspension, its final snapshot kept as it was; any
    other end, or no answer, stays as it is."""
    if end.ending is not Ending.PREEMPTED or cause is None or not cause.suspended:
        return end
    return replace(end, ending=Ending.SUSPENDED, evicted=False)


def try_exit_code(error: BaseException) -> int | None:
    """The code a step's container exits with when its loop ended with ``error`` (a
    preemption, a suspension, a fence, a restore that failed on this side, a rollback
    refused: the codes of
    :mod:`cairn.runtime.exits`), so that its orchestrator can tell them from the step's own
    errors; None for any other error (which exits as Python does)."""
    code = conclude(end_of_error(error)).exit_code
    return None if code is None else int(code)
