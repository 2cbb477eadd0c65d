"""A Checkpointer restore that fails on its own side (an injected library failure, as
cryptography 51's ``ValueError: data and buf must not overlap`` was) ends the try with
RestoreFailedExit (exit 8 for a bare script, on every rank) naming the cause, skips no
snapshot, touches no live object, and every snapshot restores once the cause is gone
(issue 32 item 4)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cairn.exceptions import RestoreFailed, RestoreFailedExit
from cairn.runtime.exits import ExitCode
from cairn.state import Checkpointer
from cairn.state.checkpointer import PersistMode
from cairn.store import Key
from cairn import open_store
from cairn.store.keyring import new_secret
from tests.support.hang import HANG_S
from tests.support.read_failure import INJECTED, failing_reads, injecting_env

REPO = Path(__file__).resolve().parents[3]
KEY = "dag/train/run-1/0"


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def checkpointer(store: object) -> Checkpointer:
    return Checkpointer(store=store, key=KEY, every_steps=4, every_seconds=None,
                        preemption=None, persist=PersistMode.INLINE)


@pytest.mark.parametrize("where", ["part", "decrypt"])
def test_a_library_failure_while_reading_ends_the_try_and_skips_nothing(
        tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture) -> None:
    secret = new_secret() if where == "decrypt" else None  # decrypt: the field failure itself
    with open_store(str(tmp_path / "store"), secret=secret) as store:
        model, opt = make(0)
        first = checkpointer(store)
        assert first.restore(model=model, optimizer=opt) == 0
        for step in range(12):  # snapshots after steps 3, 7 and 11
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            first.step(step)
        first.close()
        seqs = [info.seq for info in store.snapshots(Key.parse(KEY))]
        assert len(seqs) == 3

        model, opt = make(9)
        fresh = [p.detach().clone() for p in model.parameters()]
        ckpt = checkpointer(store)
        with failing_reads(where), caplog.at_level(logging.WARNING), \
                pytest.raises(RestoreFailedExit) as caught:
            ckpt.restore(model=model, optimizer=opt)
        ckpt.close()
        error = caught.value
        assert isinstance(error, SystemExit) and isinstance(error, RestoreFailed)
        assert error.code == ExitCode.RESTORE_FAILED == 8 and error.seq == seqs[0]
        assert f"ValueError: {INJECTED}" in str(error) and "no snapshot was skipped" in str(error)
        assert not any("skipping snapshot" in r.getMessage() for r in caplog.records), caplog.text
        logged = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert logged and INJECTED in logged[0].getMessage() and logged[0].exc_info is not None
        assert all(torch.equal(a, b) for a, b in zip(fresh, model.parameters())), "untouched"

        key = Key.parse(KEY)
        assert [info.seq for info in store.snapshots(key)] == seqs
        assert store.verify(key).ok
        again = checkpointer(store)
        assert again.restore(model=model, optimizer=opt) == 12
        assert again.restored_from is not None and again.restored_from.seq == seqs[0]
        again.close()


def tiny_training(store: Path, total: int, *, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess[str]:
    """``tests.support.tiny_training``: a bare script (no orchestrator) with a Checkpointer,
    snapshotting every 5 steps."""
    return subprocess.run(
        [sys.executable, "-m", "tests.support.tiny_training", str(store), KEY,
         str(store.parent / "weights.pt"), "--total", str(total), "--every", "5"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)


@pytest.mark.slow
def test_a_bare_script_exits_8_with_the_cause_and_resumes_once_it_is_gone(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    done = tiny_training(store, 20)
    assert done.returncode == 0, done.stderr[-2000:]
    with open_store(str(store), create=False) as opened:
        seqs = [info.seq for info in opened.snapshots(Key.parse(KEY))]

    failed = tiny_training(store, 30, env=injecting_env(tmp_path / "inject"))
    assert failed.returncode == ExitCode.RESTORE_FAILED, failed.stderr[-2000:]
    assert f"ValueError: {INJECTED}" in failed.stderr  # logged, with its traceback
    assert "Traceback" in failed.stderr and "skipping snapshot" not in failed.stderr
    assert "start " not in failed.stdout  # nothing trained from a wrong start

    with open_store(str(store), create=False) as opened:
        assert [info.seq for info in opened.snapshots(Key.parse(KEY))] == seqs
        assert opened.verify(Key.parse(KEY)).ok
    resumed = tiny_training(store, 30)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(r"^start 20$", resumed.stdout, re.M), resumed.stdout[:500]


def torchrun(store: Path, *, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "tests.support.ddp_training", str(store), KEY, str(store.parent / "ddp.pt"),
         "--total", "12", "--every", "5"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)


@pytest.mark.slow
def test_when_one_rank_fails_on_its_side_every_rank_stops_and_none_skips(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    done = torchrun(store)
    assert done.returncode == 0, done.stderr[-2000:]
    with open_store(str(store), create=False) as opened:
        seqs = [info.seq for info in opened.snapshots(Key.parse(KEY))]
    assert len(seqs) == 2  # after steps 4 and 9

    failed = torchrun(store, env=injecting_env(tmp_path / "inject", rank="1"))
    assert failed.returncode != 0
    err = failed.stderr
    assert f"ValueError: {INJECTED}" in err, err[-3000:]  # rank 1's cause
    assert f"reading snapshot seq {seqs[0]} failed on another rank" in err  # rank 0 stopped too
    # torchrun names the first rank that exited; it may stop the other before it exits 8 too.
    assert "8" in re.findall(r"exitcode\s*:\s*(-?\d+)", err), err[-3000:]
    assert "skipping snapshot" not in err and "start " not in failed.stdout

    with open_store(str(store), create=False) as opened:
        assert [info.seq for info in opened.snapshots(Key.parse(KEY))] == seqs
    resumed = torchrun(store)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(r"^start 10$", resumed.stdout, re.M), resumed.stdout[:500]
