"""How a try ends: one mapping (``cairn.runtime.session.conclude``) from a try's end to its exit
code and outcome, which the state mode, ``cairn run`` and the pod operator all reach, and no
module beside it maps an ending to an exit code or an outcome."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cairn.exceptions import (
    ConfigError,
    Fenced,
    Preempted,
    RestoreFailed,
    RestoreFailedExit,
    StoreError,
    Suspended,
)
from cairn.runtime.channel import Cause
from cairn.runtime.exits import ExitCode, error_for_exit, exit_code_for
from cairn.runtime.session import (
    Conclusion,
    Ending,
    TryEnd,
    after_cause,
    conclude,
    end_of_error,
    end_of_exit,
    end_of_pod,
    try_exit_code,
)
from cairn.store.outcomes import OutcomeKind

ROOT = Path(__file__).resolve().parents[3]
SESSION = ROOT / "cairn" / "runtime" / "session.py"


@pytest.mark.parametrize("end,conclusion", [
    (TryEnd(ending=Ending.SUCCEEDED), Conclusion(0, OutcomeKind.SUCCEEDED)),
    (TryEnd(ending=Ending.PREEMPTED, saved=True), Conclusion(75, OutcomeKind.PREEMPTED)),
    (TryEnd(ending=Ending.PREEMPTED), Conclusion(76, OutcomeKind.PREEMPTED)),
    (TryEnd(ending=Ending.PREEMPTED, evicted=True), Conclusion(76, OutcomeKind.EVICTED)),
    (TryEnd(ending=Ending.SUSPENDED, saved=True), Conclusion(77, OutcomeKind.SUSPENDED)),
    (TryEnd(ending=Ending.SUSPENDED), Conclusion(77, OutcomeKind.SUSPENDED)),
    (TryEnd(ending=Ending.FENCED), Conclusion(5, OutcomeKind.FENCED)),
    (TryEnd(ending=Ending.RESTORE_FAILED), Conclusion(8, OutcomeKind.FAILED)),
    (TryEnd(ending=Ending.FAILED, code=3), Conclusion(3, OutcomeKind.FAILED)),
    (TryEnd(ending=Ending.FAILED), Conclusion(None, OutcomeKind.FAILED)),
])
def test_each_end_concludes_to_its_code_and_outcome(end: TryEnd, conclusion: Conclusion) -> None:
    assert conclude(end) == conclusion


@pytest.mark.parametrize("code", [None, *range(256)])
def test_every_exit_code_survives_the_session(code: int | None) -> None:
    """``cairn run`` exits with what its supervisor decided: read back into an end and
    concluded, every code (the workload's own included) comes out unchanged."""
    assert conclude(end_of_exit(code)).exit_code == code
    if code is not None and code not in (0, 5, 8, 75, 76, 77):
        assert conclude(end_of_exit(code)).outcome is OutcomeKind.FAILED


@pytest.mark.parametrize("error", [
    Preempted("x", seq=3), Preempted("x"), Fenced("x"), RestoreFailed("x", seq=2),
    RestoreFailedExit("x", code=ExitCode.RESTORE_FAILED),
    Suspended("x", code=ExitCode.SUSPENDED, seq=4), Suspended("x", code=ExitCode.SUSPENDED)])
def test_a_try_ending_error_exits_with_the_commands_code_and_maps_back(error: Exception) -> None:
    code = try_exit_code(error)
    assert code == exit_code_for(error)  # what the CLI table says for the same error
    back = error_for_exit(code)
    assert type(back) is type(error) or isinstance(error, type(back))
    assert conclude(end_of_exit(code)).outcome is conclude(end_of_error(error)).outcome


@pytest.mark.parametrize("error", [ValueError("x"), ConfigError("x"), StoreError("x")])
def test_the_steps_own_errors_exit_as_python_does(error: Exception) -> None:
    assert try_exit_code(error) is None
    assert conclude(end_of_error(error)) == Conclusion(None, OutcomeKind.FAILED)
    assert conclude(end_of_error(None)) == Conclusion(0, OutcomeKind.SUCCEEDED)


def test_a_maintenance_preemption_is_an_eviction() -> None:
    assert conclude(end_of_exit(75, maintenance=True)) == Conclusion(75, OutcomeKind.EVICTED)
    assert conclude(end_of_exit(77, maintenance=True)).outcome is OutcomeKind.SUSPENDED


def test_a_pod_ended_from_outside() -> None:
    def outcome(**flags: bool) -> OutcomeKind | None:
        end = end_of_pod(**{"oom_killed": False, "drained": False, "node_ended": False, **flags})
        return None if end is None else conclude(end).outcome

    assert outcome(oom_killed=True, node_ended=True) is OutcomeKind.FAILED
    assert outcome(drained=True, node_ended=True) is OutcomeKind.EVICTED
    assert outcome(node_ended=True) is OutcomeKind.PREEMPTED
    assert outcome() is None


def test_a_preemption_whose_job_was_suspended_is_a_suspension() -> None:
    suspended = Cause(suspended=True, reason="the Job was suspended")
    other = Cause(suspended=False, reason="the node is shutting down")
    saved = TryEnd(ending=Ending.PREEMPTED, saved=True, evicted=True)
    assert after_cause(saved, suspended) == TryEnd(ending=Ending.SUSPENDED, saved=True)
    assert conclude(after_cause(end_of_exit(76), suspended)) == Conclusion(
        77, OutcomeKind.SUSPENDED)
    assert after_cause(saved, other) == saved and after_cause(saved, None) == saved
    for end in (TryEnd(ending=Ending.FENCED), TryEnd(ending=Ending.FAILED, code=2),
                TryEnd(ending=Ending.SUCCEEDED)):
        assert after_cause(end, suspended) == end


# -- who reaches the mapping ------------------------------------------------------------------

SOURCES = [ROOT / "cairn", ROOT / "providers" / "cairn_airflow" / "cairn_airflow",
           ROOT / "kfp_components" / "cairn_kfp"]
#: What names an ending on either side of the mapping.
EXIT_MEMBERS = {"PREEMPTED_SAVED", "PREEMPTED_KEPT", "SUSPENDED", "FENCED", "RESTORE_FAILED"}
OUTCOME_MEMBERS = {"SUCCEEDED", "FAILED", "PREEMPTED", "EVICTED", "SUSPENDED", "FENCED"}
ERRORS = {"Preempted", "Suspended", "Fenced", "RestoreFailed"}


def _mapping_modules() -> list[str]:
    """Modules that name an outcome kind beside an exit code or a try-ending error: a mapping
    between them."""
    found = []
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text())
            attrs = {(n.value.id, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and isinstance(n.value, ast.Name)}
            outcomes = {a for owner, a in attrs if owner == "OutcomeKind"} & OUTCOME_MEMBERS
            codes = {a for owner, a in attrs if owner == "ExitCode"} & EXIT_MEMBERS
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & ERRORS
            if outcomes and (codes or names):
                found.append(str(path.relative_to(ROOT)))
    return found


def test_only_the_session_maps_an_ending_to_a_code_or_an_outcome() -> None:
    assert _mapping_modules() == [str(SESSION.relative_to(ROOT))]


@pytest.mark.parametrize("module,calls", [
    ("cairn/runtime/endings.py", {"end_of_error", "conclude"}),  # the state mode's records
    ("cairn/runtime/try_session.py", {"conclude", "after_cause"}),  # the session's end
    ("cairn/process/supervisor.py", {"end_of_exit", "final_snapshot", "after_cause", "end"}),
    ("cairn/state/checkpointer.py", {"final_snapshot", "after_cause", "end"}),  # state mode
    ("cairn/tries.py", {"end_of_error", "conclude"}),  # the orchestrators' resume verdict
    ("providers/cairn_airflow/cairn_airflow/pod_status.py", {"end_of_pod", "conclude"}),
    ("providers/cairn_airflow/cairn_airflow/kubernetes_decorator.py", {"try_exit_code"}),
])
def test_both_modes_and_the_pod_operator_reach_the_session(module: str, calls: set[str]) -> None:
    tree = ast.parse((ROOT / module).read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert calls <= called
