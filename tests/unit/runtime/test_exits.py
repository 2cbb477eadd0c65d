"""Exit codes: each error's code, and what a step's exit code stands for, both ways."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from cairn.exceptions import (
    CairnError,
    ConfigError,
    CorruptSnapshot,
    Fenced,
    NoSnapshot,
    Preempted,
    RestoreFailed,
    RestoreFailedExit,
    RollbackRefused,
    RollbackRefusedExit,
    StoreError,
    Suspended,
)
from cairn.runtime.exits import (
    MEANINGS,
    RUN_CODES,
    ExitCode,
    describe_exit,
    describe_exit_codes,
    error_for_exit,
    exit_code_for,
    from_wait_status,
)
from cairn.runtime.session import try_exit_code


@pytest.mark.parametrize("error,code", [
    (ConfigError("x"), ExitCode.USAGE), (NoSnapshot("x"), ExitCode.NOT_FOUND),
    (CorruptSnapshot("x"), ExitCode.CORRUPT), (Fenced("x"), ExitCode.FENCED),
    (StoreError("x"), ExitCode.STORAGE), (PermissionError("x"), ExitCode.STORAGE),
    (CairnError("x"), ExitCode.INTERNAL), (RuntimeError("x"), ExitCode.INTERNAL),
    (Preempted("x", seq=4), ExitCode.PREEMPTED_SAVED), (Preempted("x"), ExitCode.PREEMPTED_KEPT),
    (Suspended("x", code=ExitCode.SUSPENDED, seq=4), ExitCode.SUSPENDED),
    (RestoreFailed("x", seq=4), ExitCode.RESTORE_FAILED),
    (RestoreFailedExit("x", code=ExitCode.RESTORE_FAILED), ExitCode.RESTORE_FAILED),
    (RollbackRefused("x", recorded=5, found=3), ExitCode.ROLLBACK_REFUSED),
    (RollbackRefusedExit("x", recorded=5, found=None, code=ExitCode.ROLLBACK_REFUSED),
     ExitCode.ROLLBACK_REFUSED),
])
def test_each_error_has_its_code(error: BaseException, code: ExitCode) -> None:
    assert exit_code_for(error) is code


def test_only_preemptions_and_fences_get_a_try_exit_code() -> None:
    assert try_exit_code(Preempted("x", seq=3)) == 75
    assert try_exit_code(Preempted("x")) == 76
    assert try_exit_code(Fenced("x")) == 5
    assert try_exit_code(RestoreFailed("x")) == 8
    assert try_exit_code(RollbackRefused("x", recorded=5, found=3)) == 9
    assert try_exit_code(ValueError("x")) is None


@pytest.mark.parametrize("error", [Preempted("x", seq=3), Preempted("x"), Fenced("x"),
                                   Suspended("x", code=ExitCode.SUSPENDED, seq=3),
                                   RestoreFailed("x", seq=3),
                                   RollbackRefused("x", recorded=5, found=3)])
def test_a_try_exit_code_maps_back_to_its_error(error: CairnError) -> None:
    code = try_exit_code(error)
    assert code is not None
    assert type(error_for_exit(code, key="d/t/r")) is type(error)


@pytest.mark.parametrize("code", [0, 1, 2, 6, 7, 137])
def test_other_codes_are_not_cairn_errors(code: int) -> None:
    assert error_for_exit(code) is None


def test_a_script_that_lets_suspended_propagate_exits_with_its_code() -> None:
    script = ("from cairn.exceptions import Suspended\n"
              "from cairn.runtime.exits import ExitCode\n"
              "raise Suspended('asked', code=ExitCode.SUSPENDED, seq=3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == ExitCode.SUSPENDED == try_exit_code(
        Suspended("x", code=ExitCode.SUSPENDED))
    assert isinstance(Suspended("x", code=ExitCode.SUSPENDED), CairnError), "except Exception"


def test_a_script_that_lets_restore_failed_exit_propagate_exits_8() -> None:
    script = ("from cairn.exceptions import RestoreFailedExit\n"
              "from cairn.runtime.exits import ExitCode\n"
              "raise RestoreFailedExit('reading failed', code=ExitCode.RESTORE_FAILED, seq=3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == ExitCode.RESTORE_FAILED == 8
    assert "no snapshot was skipped" in str(error_for_exit(8, where="the pod"))


def test_a_script_that_lets_a_rollback_refusal_propagate_exits_9() -> None:
    script = ("from cairn.exceptions import RollbackRefusedExit\n"
              "from cairn.runtime.exits import ExitCode\n"
              "raise RollbackRefusedExit('refused', recorded=5, found=3, "
              "code=ExitCode.ROLLBACK_REFUSED)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == ExitCode.ROLLBACK_REFUSED == 9 and proc.stderr == b""
    error = error_for_exit(9, key="d/t/r", where="the pod")
    assert isinstance(error, RollbackRefused) and error.recorded is None
    assert "the pod refused to begin the try of d/t/r" in str(error)
    assert "CAIRN_ALLOW_ROLLBACK=1" in str(error)


def test_descriptions_name_the_fix() -> None:
    assert "cairn doctor" in describe_exit(7)
    assert "no snapshot was skipped" in describe_exit(8)
    assert "128+N" in describe_exit(3)


def test_every_code_has_one_meaning_and_the_help_prints_the_table(
        capsys: pytest.CaptureFixture[str]) -> None:
    from cairn.cli.main import build_parser

    assert set(MEANINGS) == set(ExitCode)
    table = describe_exit_codes()
    assert [int(line.split()[0]) for line in table.splitlines() if not line.startswith("   ")] \
        == [int(c) for c in ExitCode]
    assert all(len(line) <= 79 for line in table.splitlines())
    assert table in build_parser().format_help()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    run_help = capsys.readouterr().out
    assert describe_exit_codes(RUN_CODES) in run_help and "128+N" in run_help


def test_wait_status_reads_like_a_shell() -> None:
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    _, status = os.waitpid(exited.pid, 0)
    assert from_wait_status(status) == 3
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    killed.send_signal(signal.SIGKILL)
    _, status = os.waitpid(killed.pid, 0)
    assert from_wait_status(status) == 128 + signal.SIGKILL
