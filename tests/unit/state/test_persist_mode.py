"""PersistMode: "sidecar" names only the pod's container now; the writer process is
``PersistMode.PROCESS``, and the old spelling still selects it."""

from __future__ import annotations

import pytest

from cairn.state.checkpointer import PersistMode


def test_the_old_name_selects_the_writer_process() -> None:
    assert PersistMode("sidecar") is PersistMode.PROCESS
    assert PersistMode.SIDECAR is PersistMode.PROCESS
    assert [m.value for m in PersistMode] == ["process", "inline"]


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="'thread' is not a valid PersistMode"):
        PersistMode("thread")
