"""Snapshots written by an older cairn still restore: the committed stores under
``tests/fixtures/compat/`` (written by :mod:`tests.support.compat_stores`, one folder per
format, never rewritten) are restored by today's code, state and process mode, plain and
encrypted, and give back exactly what was snapshotted.

Each test restores a copy: a restore opens an attempt, which writes to the store.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cairn.state import Checkpointer
from tests.support.cairn_run import CairnRun, can_run_criu
from tests.support.compat_stores import build_counter, small_training, state_digests, work_folder

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "compat").iterdir())
VARIANTS = ("plain", "sealed")


def _expected(fixture: Path) -> dict[str, Any]:
    return json.loads((fixture / "expected.json").read_text())


def _copy(fixture: Path, store: str, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A copy of one of the fixture's stores, and the environment that opens it (a sealed
    one's secret copied with the owner-only mode a secret file must have)."""
    copy = tmp_path / store
    shutil.copytree(fixture / store, copy)
    if not store.endswith("sealed"):
        return str(copy), {}
    secret = tmp_path / "secret.json"
    shutil.copyfile(fixture / "secret.json", secret)
    secret.chmod(0o600)
    return str(copy), {"CAIRN_SECRET_FILE": str(secret)}


def test_the_fixtures_are_there() -> None:
    assert FIXTURES, "tests/fixtures/compat/ holds no fixture"
    for fixture in FIXTURES:
        assert {f"{mode}-{v}" for mode in ("state", "process") for v in VARIANTS} \
            <= set(_expected(fixture)), fixture


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_an_old_state_snapshot_restores_every_tensor_bit_identical(
        fixture: Path, variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _expected(fixture)[f"state-{variant}"]
    url, env = _copy(fixture, f"state-{variant}", tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model, optimizer, scheduler = small_training()
    before = state_digests(model, optimizer, scheduler)
    ckpt = Checkpointer(store=url, key=want["key"])
    try:
        assert ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler) \
            == want["next_step"]
    finally:
        ckpt.close()
    got = state_digests(model, optimizer, scheduler)
    assert got == want["digests"]
    assert got != before, "the fresh objects already held the snapshot's values"


@pytest.mark.parametrize("mode", ["state", "process"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_cairn_verify_reads_and_checks_every_old_snapshot(
        fixture: Path, variant: str, mode: str, tmp_path: Path) -> None:
    url, env = _copy(fixture, f"{mode}-{variant}", tmp_path)
    done = subprocess.run([sys.executable, "-m", "cairn.cli.main", "verify", url],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    checked = [line for line in done.stdout.splitlines() if line.endswith(": ok")]
    assert len(checked) >= 2 and done.stdout.rstrip().endswith("all ok"), done.stdout


@pytest.mark.isolated
@pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_an_old_process_snapshot_restores_and_the_counter_runs_to_its_end(
        fixture: Path, variant: str, tmp_path: Path) -> None:
    """The counter was SIGKILLed with cairn run after its second snapshot; cairn run with the
    same key restores that snapshot (the counter's memory checks itself: a page that came back
    wrong ends it with 5), and the counter counts on to its end: every step once, the metrics
    file cut back to the snapshot's, as a fresh node restores it."""
    expected = _expected(fixture)
    want = expected[f"process-{variant}"]
    work = work_folder(fixture)
    shutil.rmtree(work, ignore_errors=True)
    refused: str | None = None
    try:
        built = build_counter(fixture / "counter.c", Path(want["command"][0]),
                              expected["counter_flags"])
        assert built == expected["counter_sha256"], (
            "this gcc builds the fixture's counter to other bytes, and a CRIU image restores "
            "only onto the executable it mapped: keep a toolchain that builds it the same")
        cwd = Path(want["cwd"])
        cwd.mkdir(parents=True)
        url, env = _copy(fixture, f"process-{variant}", tmp_path)
        run = CairnRun(store=url, key=want["key"], command=want["command"],
                       workdir=Path(want["workdir"]), logs=tmp_path / "logs", env=env, cwd=cwd)
        assert run.wait(120) == 0, run.stderr
        steps = [int(line) for line in (cwd / "metrics.txt").read_text().splitlines()]
        assert steps == list(range(want["steps"])), run.stderr
        refused = _host_refusal(run.stderr, seq=want["newest_seq"])
        if refused is None:
            assert f"restored snapshot seq {want['newest_seq']} " in run.stderr, run.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if refused is not None:
        pytest.skip(f"a process image restores only on a host like the one it was taken on, "
                    f"and this one differs ({refused[:200]}); cairn read the old snapshot, "
                    "named the difference and ran the counter fresh to its end")


# What only the host decides: a snapshot of another kernel or CPU is refused on purpose.
HOST_DIFFERENCES = ("kernel differs", "CPU model differs", "CPU flags differ",
                    "architecture differs")


def _host_refusal(stderr: str, *, seq: int) -> str | None:
    """The reasons cairn gave for not restoring snapshot ``seq`` when they are all differences
    of the host (kernel, CPU); None when it did not refuse. Any other reason (the record's
    format, the command, the directory, CRIU) fails the test: those are the old snapshot's to
    pass."""
    marker = f"starting fresh: snapshot seq {seq} does not fit: "
    if marker not in stderr:
        return None
    reasons = stderr.split(marker, 1)[1].splitlines()[0]
    named = [r for r in HOST_DIFFERENCES if r in reasons]
    others = ("record format", "command changed", "working directory changed",
              "CRIU version", "container image", "GPU", "NVIDIA", "CUDA")
    assert named and not any(o in reasons for o in others), reasons
    return reasons
