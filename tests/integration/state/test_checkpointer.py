"""Checkpointer semantics: restore returns the next step, all-or-nothing, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from cairn.exceptions import ConfigError, Fenced, RollbackRefused
from cairn.state import Checkpointer
from cairn.state.capture import StateMismatch
from cairn.state.codec import tensor_path
from cairn.store import Key, Store
from tests.support import tamper
from tests.support.hang import HANG_S
from tests.support.signals import restore_signal_handlers  # noqa: F401 - autouse

KEY = "dag/train/run-1/0"


def make(seed: int = 0, hidden: int = 8):  # noqa: ANN201
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def train_step(model, opt) -> None:  # noqa: ANN001
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_fresh_start_then_resume_from_last_snapshot(store: Store) -> None:
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=3, every_seconds=None)
    assert ckpt.restore(model=model, optimizer=opt) == 0
    saved = []
    for step in range(7):
        train_step(model, opt)
        if ckpt.step(step):
            saved.append(step)
    assert saved == [2, 5]
    ckpt.extras["note"] = "hello"
    ckpt.save(6)
    ckpt.close()  # waits until the last snapshot is durable
    model2, opt2 = make(seed=99)
    again = Checkpointer(store=store, key=KEY)
    assert again.restore(model=model2, optimizer=opt2) == 7
    assert again.extras == {"note": "hello"}
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["momentum_buffer"].shape == (8, 4)


def test_corrupt_newest_falls_back_and_never_loads_it(store: Store) -> None:
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=1, every_seconds=None)
    ckpt.restore(model=model, optimizer=opt)
    train_step(model, opt)
    ckpt.step(0)
    good = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt)
    newest = ckpt.save(1, wait=True)
    assert newest is not None and newest.step == 1
    ckpt.close()
    chunk = newest.file(tensor_path(0)).chunks[0]
    tamper.flip_byte(store.backend, chunk.pack, chunk.offset)
    model2, opt2 = make(seed=5)
    # This machine saw the newest commit: going back to the previous one is a rollback,
    # refused unless allowed (ADR 0049).
    with pytest.raises(RollbackRefused, match=f"committed snapshot seq {newest.seq}; the newer"):
        Checkpointer(store=store, key=KEY).restore(model=model2, optimizer=opt2)
    assert Checkpointer(store=store, key=KEY, allow_rollback=True).restore(
        model=model2, optimizer=opt2) == 1
    for a, b in zip(good, model2.parameters()):
        assert torch.equal(a, b)


def test_excluded_snapshots_are_never_restored_and_the_open_record_says_so(store: Store) -> None:
    """A resume policy's verdict (cairn.policy.resume): skip seq X, fall back to the one before,
    then start fresh; the attempt's open record names what it really resumed from."""
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=1, every_seconds=None)
    ckpt.restore(model=model, optimizer=opt)
    seqs = []
    for step in range(2):
        train_step(model, opt)
        seqs.append(ckpt.save(step, wait=True).seq)  # type: ignore[union-attr]
    ckpt.close()
    older, newer = seqs
    model2, opt2 = make(seed=5)
    back = Checkpointer(store=store, key=KEY, exclude_seqs=[newer])
    assert back.restore(model=model2, optimizer=opt2) == 1
    assert back.restored_from is not None and back.restored_from.seq == older
    back.close()
    fresh = Checkpointer(store=store, key=KEY, exclude_seqs={older, newer})
    assert fresh.restore(model=model2, optimizer=opt2) == 0 and fresh.restored_from is None
    fresh.close()
    tries = store.records.tries(Key.parse(KEY))
    assert [t.resumed_from for t in tries] == [None, older, None]


def test_exclude_seqs_from_the_environment(monkeypatch: pytest.MonkeyPatch, backend_url: str) -> None:
    monkeypatch.setenv("CAIRN_STORE", backend_url)
    monkeypatch.setenv("CAIRN_KEY", KEY)
    monkeypatch.setenv("CAIRN_EXCLUDE_SEQS", "7,9")
    ckpt = Checkpointer.from_env()
    assert ckpt.exclude_seqs == {7, 9}
    ckpt.close()
    monkeypatch.setenv("CAIRN_EXCLUDE_SEQS", "seven")
    with pytest.raises(ConfigError, match="CAIRN_EXCLUDE_SEQS must be comma-separated"):
        Checkpointer.from_env()


def test_changed_architecture_is_refused_before_anything_loads(store: Store) -> None:
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY)
    ckpt.restore(model=model, optimizer=opt)
    ckpt.save(0)
    ckpt.close()
    bigger, bigger_opt = make(seed=3, hidden=16)
    before = [p.detach().clone() for p in bigger.parameters()]
    with pytest.raises(StateMismatch, match=r"snapshot \(8, 4\).*live \(16, 4\)"):
        Checkpointer(store=store, key=KEY).restore(model=bigger, optimizer=bigger_opt)
    for a, b in zip(before, bigger.parameters()):
        assert torch.equal(a, b)


def test_plain_dataloader_is_refused_naming_the_fix(store: Store) -> None:
    model, opt = make()
    loader = DataLoader(list(range(10)))
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        Checkpointer(store=store, key=KEY).restore(model=model, optimizer=opt, loader=loader)


def test_fenced_checkpointer_raises_on_step(store: Store) -> None:
    model, opt = make()
    zombie = Checkpointer(store=store, key=KEY, every_steps=1, every_seconds=None)
    zombie.restore(model=model, optimizer=opt)
    retry = Checkpointer(store=store, key=KEY)
    retry.restore(model=model, optimizer=opt)
    with pytest.raises(Fenced):
        # Staged, and the writer process finds the log moved on; or refused at once, when the
        # writer, started late on a busy machine, found the newer attempt as it started.
        zombie.step(0)
        zombie.wait()
    with pytest.raises(Fenced):
        zombie.step(1)
    with pytest.raises(Fenced):
        zombie.close()
    retry.close()


def test_from_env(monkeypatch: pytest.MonkeyPatch, backend_url: str) -> None:
    monkeypatch.delenv("CAIRN_STORE", raising=False)
    with pytest.raises(ConfigError, match="CAIRN_STORE and CAIRN_KEY"):
        Checkpointer.from_env()
    monkeypatch.setenv("CAIRN_STORE", backend_url)
    monkeypatch.setenv("CAIRN_KEY", KEY)
    monkeypatch.setenv("CAIRN_EVERY_STEPS", "4")
    ckpt = Checkpointer.from_env()
    assert ckpt.key == Key.parse(KEY) and ckpt.policy.every_steps == 4
    ckpt.close()


def test_step_before_restore_is_an_error(store: Store) -> None:
    with pytest.raises(ConfigError, match="call restore"):
        Checkpointer(store=store, key=KEY).step(0)


def test_adaptive_interval_uses_measured_cost_and_observed_attempts(store: Store) -> None:
    from cairn.state.checkpointer import SnapshotPolicy

    model, opt = make()
    for _ in range(2):  # two earlier attempts: a preemption history
        Checkpointer(store=store, key=KEY, preemption=None).restore(model=model, optimizer=opt)
    policy = SnapshotPolicy(every_seconds=300, adaptive=True, min_seconds=1e-3, max_seconds=1e6)
    ckpt = Checkpointer(store=store, key=KEY, policy=policy, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    assert ckpt.mtbf_s is not None and ckpt.mtbf_s > 0
    assert ckpt.interval_seconds() == 300  # no measured cost yet
    ckpt.save(0, wait=True)
    assert ckpt.snapshot_cost_s is not None
    expected = (2 * ckpt.snapshot_cost_s * ckpt.mtbf_s) ** 0.5
    assert ckpt.interval_seconds() == pytest.approx(expected)


def big_model():  # noqa: ANN201
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096)  # 64 MiB of weights, 64 MiB of momentum
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    return model, opt


def test_writer_killed_mid_persist_training_goes_on_nothing_partial(store: Store, caplog) -> None:
    import os
    import signal

    model, opt = big_model()
    ckpt = Checkpointer(store=store, key=KEY, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    first = ckpt.save(0, wait=True)
    assert first is not None
    opt.step()
    ckpt.save(1)  # staged; the writer is now chunking and hashing 128 MiB
    os.kill(ckpt.writer_pid, signal.SIGKILL)
    with caplog.at_level("ERROR"):
        assert ckpt.wait(timeout=HANG_S)
    assert "not committed" in caplog.text and "exited" in caplog.text
    assert [i.seq for i in store.snapshots(Key.parse(KEY))] == [first.seq]
    assert store.verify(Key.parse(KEY)).ok
    opt.step()
    third = ckpt.save(2, wait=True)  # a new writer process takes over the attempt
    assert third is not None and third.step == 2 and third.seq > first.seq
    ckpt.close()
    model2, opt2 = big_model()
    assert Checkpointer(store=store, key=KEY, preemption=None).restore(model=model2, optimizer=opt2) == 3
    assert torch.equal(model2.weight, model.weight)


def test_skip_when_busy_and_inline_mode(store: Store) -> None:
    import os
    import signal

    from cairn.state.checkpointer import PersistMode, WhenBusy

    model, opt = big_model()
    ckpt = Checkpointer(store=store, key=KEY, preemption=None, when_busy=WhenBusy.SKIP)
    ckpt.restore(model=model, optimizer=opt)
    ckpt.save(0)
    os.kill(ckpt.writer_pid, signal.SIGSTOP)  # hold the writer busy, deterministically
    try:
        ckpt.save(1)  # staged only if step 0 was already committed
        ckpt.save(2)  # the one buffer is certainly busy now
    finally:
        os.kill(ckpt.writer_pid, signal.SIGCONT)
    assert ckpt.skipped >= 1, "saves while the writer was busy were skipped, not queued"
    ckpt.close()
    assert store.manifest(Key.parse(KEY)).step in (0, 1)
    inline = Checkpointer(store=store, key=KEY, preemption=None, persist=PersistMode.INLINE)
    start = inline.restore(model=model, optimizer=opt)
    manifest = inline.save(start)
    assert manifest is not None and store.manifest(Key.parse(KEY)).seq == manifest.seq
    inline.close()


def test_finish_through_the_writer_marks_done(store: Store) -> None:
    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    ckpt.save(0)
    ckpt.finish()
    ckpt.close()
    assert store.snapshots(Key.parse(KEY)) == []
    assert Checkpointer(store=store, key=KEY, preemption=None).restore(model=model, optimizer=opt) == 0


def test_every_dtype_and_layout_survives_staging_and_restore(store: Store) -> None:
    import numpy as np

    model, opt = make()
    odd = {
        "strided": torch.randn(64, 48)[:, 3:40],
        "scalar": torch.tensor(2.5),
        "bf16": torch.randn(33).to(torch.bfloat16),
        "complex": torch.randn(6, dtype=torch.complex64).conj(),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "numpy": np.arange(10, dtype=">u4"),
        "big": torch.randn(512, 1024),  # split across the copying threads
    }
    ckpt = Checkpointer(store=store, key=KEY, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    ckpt.extras.update(odd)
    assert ckpt.save(0, wait=True) is not None
    ckpt.close()
    again = Checkpointer(store=store, key=KEY, preemption=None)
    assert again.restore(model=model, optimizer=opt) == 1
    again.close()
    for name, value in odd.items():
        got = again.extras[name]
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and np.array_equal(got, value)
        else:
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert torch.equal(got, value.resolve_conj()), name


def test_the_writer_is_started_by_restore(store: Store) -> None:
    import os

    model, opt = make()
    ckpt = Checkpointer(store=store, key=KEY, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    pid = ckpt.writer_pid  # no snapshot yet
    assert pid is not None
    os.kill(pid, 0)  # alive
    ckpt.close()


def test_close_right_after_restore_leaves_no_writer_process(store: Store) -> None:
    import os

    def writers() -> set[int]:
        found = set()
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == os.getpid() and b"cairn.state.writer_process" in command:
                found.add(int(entry))
        return found

    model, opt = make()
    before = writers()
    ckpt = Checkpointer(store=store, key=KEY, preemption=None)
    ckpt.restore(model=model, optimizer=opt)
    ckpt.close()
    assert writers() <= before


def test_step_raises_only_after_max_failures_in_a_row(store: Store, caplog) -> None:
    import os
    import signal

    from cairn.exceptions import StoreError

    with pytest.raises(ConfigError, match="max_failures"):
        Checkpointer(store=store, key=KEY, max_failures=0)
    model, opt = big_model()
    ckpt = Checkpointer(store=store, key=KEY, every_steps=10**6, every_seconds=None,
                        preemption=None, max_failures=3)
    ckpt.restore(model=model, optimizer=opt)

    def failed_snapshot(step: int) -> None:
        opt.step()  # new bytes: the writer has 128 MiB to hash before it could commit
        ckpt.save(step)
        os.kill(ckpt.writer_pid, signal.SIGKILL)
        assert ckpt.wait(timeout=HANG_S)

    with caplog.at_level("ERROR"):
        failed_snapshot(0)
        failed_snapshot(1)
        assert not ckpt.step(2)  # two in a row: logged, training goes on
    assert ckpt.failures == 2 and "2 of 3 allowed" in caplog.text
    assert ckpt.save(3, wait=True) is not None  # a new writer; a success resets the count
    assert ckpt.failures == 0
    failed_snapshot(4)
    failed_snapshot(5)
    ckpt.step(6)  # again only max_failures - 1 in a row
    failed_snapshot(7)
    with pytest.raises(StoreError, match=r"3 snapshots in a row .*exited"):
        ckpt.step(8)
    with pytest.raises(StoreError):
        ckpt.step(9)  # and it keeps raising
    with pytest.raises(StoreError, match="not committed"):
        ckpt.close()
    assert [i.manifest.step for i in store.snapshots(Key.parse(KEY))] == [3]


def test_the_writer_exits_with_its_trainer_whatever_the_trainer_forked(tmp_path) -> None:  # noqa: ANN001
    """A child the trainer forked (a DataLoader worker) and that outlives it must not keep the
    writer process alive: it closes its copy of the trainer's end of the writer's socket."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    trainer = subprocess.Popen([sys.executable, "-m", "tests.support.forking_trainer",
                                str(tmp_path / "store"), KEY], cwd=repo, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert trainer.stdout is not None
    pids = dict(trainer.stdout.readline().split() for _ in range(2))
    writer, child = int(pids["writer"]), int(pids["child"])
    try:
        trainer.kill()
        trainer.wait(timeout=HANG_S)
        deadline = time.monotonic() + HANG_S
        while _alive(writer) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(writer), "the writer outlived its trainer while a fork of it lived"
        assert _alive(child)  # the fork lived on, as a stuck worker does
    finally:
        for pid in (child, writer):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or a pid no longer there, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
