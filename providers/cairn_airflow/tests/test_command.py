"""CairnRunOperator without a scheduler: its command line, its exit-code contract (with a
stand-in for the ``cairn`` executable that exits as ``cairn run`` does), and ``on_kill``.
The real thing (cairn run with CRIU under a real scheduler) is in test_scheduler_e2e.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from cairn.exceptions import ConfigError, Fenced, Preempted, RestoreFailed
from cairn_airflow import command as command_mod
from cairn_airflow.command import CairnRunOperator


def _context(pushed: list[tuple[str, Any]]) -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="d", task_id="t", run_id="r", map_index=-1, try_number=1,
                         xcom_push=lambda key, value: pushed.append((key, value)))
    return {"ti": ti}


def test_a_shell_string_or_an_empty_command_is_refused() -> None:
    with pytest.raises(ConfigError, match="non-empty list"):
        CairnRunOperator(task_id="x", command="python train.py")
    with pytest.raises(ConfigError, match="non-empty list"):
        CairnRunOperator(task_id="x", command=[])
    with pytest.raises(ConfigError, match="bad every"):
        CairnRunOperator(task_id="x", command=["true"], every=0)


def test_the_command_line_names_store_key_interval_and_grace() -> None:
    op = CairnRunOperator(task_id="x", command=["python", "train.py", "--lr", "0.1"], every=30,
                          grace="4s", keep_snapshots=True, workdir="/scratch")
    argv = op.cairn_argv("/data/store", "d/t/r/-1")
    assert argv[argv.index("run"):] == [
        "run", "--store", "/data/store", "--key", "d/t/r/-1", "--every", "30s", "--grace", "4s",
        "--workdir", "/scratch", "--keep", "--", "python", "train.py", "--lr", "0.1"]


@pytest.mark.parametrize(("code", "error"), [(75, Preempted), (76, Preempted), (5, Fenced),
                                             (7, Exception), (3, Exception),
                                             (8, AirflowFailException)])
def test_exit_codes_become_the_documented_errors(code: int, error: type[BaseException],
                                                 tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = tmp_path / "cairn"
    stand_in.write_text(f"#!/bin/sh\necho \"cairn run: stand-in exiting {code}\"\nexit {code}\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(command_mod, "cairn_executable", lambda: [str(stand_in)])
    pushed: list[tuple[str, Any]] = []
    op = CairnRunOperator(task_id="x", command=["true"], store_url=str(tmp_path / "store"))
    with pytest.raises(error) as caught:
        op.execute(_context(pushed))
    if code == 7:
        assert "cairn doctor" in str(caught.value)
    if code == 8:  # the restore failed on the worker's side: no retry is spent on it
        assert isinstance(caught.value.__cause__, RestoreFailed)
        assert "no snapshot was skipped" in str(caught.value)
    assert [k for k, _ in pushed] == ["cairn"] and pushed[0][1]["exit_code"] == code


def test_success_returns_the_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = tmp_path / "cairn"
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(command_mod, "cairn_executable", lambda: [str(stand_in)])
    op = CairnRunOperator(task_id="x", command=["true"], store_url=str(tmp_path / "store"))
    meta = op.execute(_context([]))
    assert meta["exit_code"] == 0 and meta["key"] == "d/t/r/-1"


def test_on_kill_only_signals_the_supervisor_and_returns() -> None:
    op = CairnRunOperator(task_id="x", command=["true"])
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    op._proc = proc
    op.on_kill()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    op.on_kill()  # after the end: nothing to signal, no error
