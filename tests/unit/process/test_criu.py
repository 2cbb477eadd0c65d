"""The CRIU binary helpers that run it: feature probes, against a stand-in script (a real
subprocess; tests/integration/process runs the real CRIU)."""

from __future__ import annotations

import os
from pathlib import Path

from cairn.process import criu


def stand_in(tmp_path: Path, *, has: str, gate: Path) -> str:
    """An executable that answers ``check --feature NAME`` as CRIU does (0 when it has it),
    once ``gate`` exists; it gives up after 20 s with 2 (an answer of "no")."""
    path = tmp_path / "criu"
    path.write_text("#!/bin/sh\n"
                    f'for i in $(seq 200); do [ -e "{gate}" ] && break; sleep 0.1; done\n'
                    f'[ -e "{gate}" ] || exit 2\n'
                    f'[ "$1 $2 $3" = "check --feature {has}" ] && exit 0\nexit 1\n')
    os.chmod(path, 0o755)
    return str(path)


def test_a_feature_probe_answers_as_has_feature_and_runs_beside_its_caller(
        tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    binary = stand_in(tmp_path, has="uffd-noncoop", gate=gate)
    # Both probes return at once, their checks waiting on the gate: had a probe waited for its
    # answer, the gate would never open and the answers would be "no".
    have = criu.probe_feature(binary, "uffd-noncoop")
    lack = criu.probe_feature(binary, "mem-dirty-track")
    gate.touch()
    assert (have(), lack()) == (True, False)
    assert have() is True  # asked again: the same answer
    assert (criu.has_feature(binary, "uffd-noncoop"),
            criu.has_feature(binary, "mem-dirty-track")) == (True, False)
    assert criu.probe_feature(str(tmp_path / "missing"), "uffd-noncoop")() is False
