"""The one classifier of reading failures (cairn.store.verdicts): a store verdict, a cairn
error or an I/O error passes unchanged; anything else (a library error, a bug, out of memory)
becomes RestoreFailed naming it, with it as the cause."""

from __future__ import annotations

import logging

import pytest

from cairn.exceptions import (
    CorruptSnapshot,
    CriuFailed,
    NoSnapshot,
    RestoreFailed,
    RestoreFailedExit,
    StoreError,
    UnsafePath,
)
from cairn.runtime.exits import ExitCode
from cairn.store.sealing import SealBroken
from cairn.store.verdicts import as_read_failure, reading, restore_failed_exit


@pytest.mark.parametrize("error", [
    CorruptSnapshot("digest mismatch", seq=3), SealBroken("failed authentication"),
    UnsafePath("outside the roots"), StoreError("unreachable"), NoSnapshot("none"),
    CriuFailed("criu"), RestoreFailed("already classified"), PermissionError("EACCES"),
    KeyboardInterrupt(), SystemExit(3)])
def test_verdicts_and_cairn_and_io_errors_pass_unchanged(error: BaseException) -> None:
    assert as_read_failure(error, seq=3) is error


@pytest.mark.parametrize("error", [
    ValueError("data and buf must not overlap"), TypeError("bad argument"), KeyError("k"),
    RuntimeError("torch"), MemoryError(), AssertionError("a bug")])
def test_anything_else_is_a_restore_failure_naming_it(error: Exception) -> None:
    failure = as_read_failure(error, seq=7)
    assert isinstance(failure, RestoreFailed) and not isinstance(failure, CorruptSnapshot)
    assert failure.seq == 7 and failure.__cause__ is error
    assert "snapshot seq 7" in str(failure) and type(error).__name__ in str(failure)
    assert "no snapshot was skipped" in str(failure)


def test_reading_raises_the_classified_failure_from_its_cause() -> None:
    with pytest.raises(RestoreFailed, match="ValueError: injected") as caught:
        with reading(4):
            raise ValueError("injected")
    assert isinstance(caught.value.__cause__, ValueError) and caught.value.seq == 4
    with pytest.raises(CorruptSnapshot, match="mismatch"):
        with reading(4):
            raise CorruptSnapshot("mismatch", seq=4)
    with reading(None):
        pass  # nothing raised, nothing changed


def test_the_exit_variant_is_a_system_exit_with_the_code_and_logs_the_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    try:
        with reading(5):
            raise ValueError("injected library failure")
    except RestoreFailed as e:
        failure = e
    logger = logging.getLogger("tests.verdicts")
    with caplog.at_level(logging.ERROR, logger="tests.verdicts"):
        exit_error = restore_failed_exit(failure, code=ExitCode.RESTORE_FAILED, logger=logger)
    assert isinstance(exit_error, RestoreFailedExit) and isinstance(exit_error, SystemExit)
    assert exit_error.code == 8 and exit_error.seq == 5
    assert isinstance(exit_error.__cause__, ValueError)
    (record,) = caplog.records
    assert "ValueError: injected library failure" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is ValueError  # its traceback
