"""State mode on Kubernetes: a real ``Checkpointer`` training real torch takes the sidecar's
notice file (``CAIRN_NOTICE_FILE``, as the pod transform sets it) in ``step()``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from cairn.exceptions import Preempted
from cairn.runtime import channel
from cairn.state import Checkpointer
from cairn.state.checkpointer import PersistMode
from cairn.store import Key
from cairn import open_store
from tests.support.signals import restore_signal_handlers  # noqa: F401 - autouse

KEY = "dag/train/run-1"


def _train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, notice_at: int,
           deadline_in: float, every_steps: int | None) -> tuple[Preempted, Checkpointer, int]:
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    notice_file = str(shared / channel.NOTICE_NAME)
    monkeypatch.setenv("CAIRN_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("CAIRN_KEY", KEY)
    monkeypatch.setenv("CAIRN_NOTICE_FILE", notice_file)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Inline persistence: the writer process is not what these tests are about.
    ckpt = Checkpointer.from_env(every_steps=every_steps, every_seconds=None,
                                 persist=PersistMode.INLINE)
    ckpt.restore(model=model, optimizer=opt)
    step = -1
    try:
        with pytest.raises(Preempted) as caught:
            for step in range(1000):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                if step == notice_at:  # the sidecar writes its notice, as on a spot reclaim
                    now = time.time()
                    channel.write_notice(notice_file, channel.Notice(
                        source="gce-preempted", reason="instance/preempted is TRUE",
                        issued_at=now, deadline=now + deadline_in))
                ckpt.step(step)
                if step > notice_at:
                    # step() polls the file at most twice a second: let the poll come due.
                    time.sleep(0.05)
    finally:
        ckpt.close()
    assert not Path(notice_file).exists()  # taken
    return caught.value, ckpt, step  # the step whose step() call raised


def test_a_notice_file_ends_in_a_final_snapshot(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    preempted, _ckpt, last = _train(tmp_path, monkeypatch, notice_at=5, deadline_in=15,
                                           every_steps=None)
    assert preempted.seq is not None
    assert "notice from gce-preempted" in str(preempted)
    with open_store(str(tmp_path / "store"), create=False) as store:
        (info, *_) = store.snapshots(Key.parse(KEY))
        assert (info.seq, info.manifest.step) == (preempted.seq, last)  # the final one
        assert store.verify(Key.parse(KEY)).ok


def test_a_notice_past_its_deadline_keeps_the_last_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Periodic snapshots measure the cost first; a deadline already gone leaves no budget.
    preempted, ckpt, last = _train(tmp_path, monkeypatch, notice_at=5, deadline_in=-1,
                                every_steps=2)
    assert ckpt.snapshot_cost_s is not None
    assert preempted.seq is None and "no final snapshot" in str(preempted)
    with open_store(str(tmp_path / "store"), create=False) as store:
        newest = store.snapshots(Key.parse(KEY))[0].manifest
    assert newest.step < last and (newest.step + 1) % 2 == 0  # a periodic one


def test_a_state_mode_trainer_reports_the_sidecars_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CAIRN_STATUS_FILE`` (set by the transform): the Checkpointer writes the status the
    sidecar serves: committed snapshots with their bytes and stall, a resume and the steps it
    saved, a failed snapshot's error, and the notice it acted on."""
    from cairn.k8s import metrics

    status_file = tmp_path / "shared" / channel.STATUS_NAME
    monkeypatch.setenv("CAIRN_STATUS_FILE", str(status_file))
    caught, ckpt, last = _train(tmp_path, monkeypatch, notice_at=7, deadline_in=30.0,
                                every_steps=3)
    first = channel.read_status(str(status_file))
    assert first is not None and first.resumes == 0
    # Every third step up to the notice's poll, then the final one after step ``last``.
    periodic = sum((s + 1) % 3 == 0 for s in range(last))
    assert first.snapshots == periodic + 1 and first.last_seq == caught.seq
    assert first.bytes_written > 0 and first.stall_seconds > 0
    assert first.notices == {"gce-preempted": 1}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    again = Checkpointer.from_env(every_steps=1, every_seconds=None, persist=PersistMode.PROCESS)
    assert again.restore(model=model, optimizer=opt) == last + 1
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    again.save(last + 1, wait=True)
    again.close()
    second = channel.read_status(str(status_file))
    assert second is not None
    assert (second.resumes, second.work_saved_steps, second.snapshots) == (1, last + 1, 1)
    assert second.bytes_written > 0 and second.failures == 0 and second.last_seq is not None
    page = metrics.render(second, notices_sent={}, watchers_healthy={})
    assert f"cairn_work_saved_steps_total {last + 1}" in page
    assert "cairn_snapshots_total 1" in page
