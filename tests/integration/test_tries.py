"""The try object on a real store with a real Checkpointer: plan from the history, the
environment and command line it hands out, one outcome per epoch, the verdicts, done."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cairn import AfterTry, GaveUp, Key, Preempted, ResumePolicy, Try, open_store
from cairn.cli.main import build_parser
from cairn.store.slotlog import RecordKind

KEY = Key(("dag", "train", "run-1", "-1"))


def _train(t: Try, steps: int, *, every: int = 2) -> object:
    """Run a tiny fit through ``t``'s Checkpointer; returns the (closed) Checkpointer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    ckpt = t.checkpointer(every_steps=every, persist="inline")
    start = ckpt.restore(model=model)
    for step in range(start, steps):
        model(torch.ones(1, 2)).sum().backward()
        ckpt.step(step)
    ckpt.close()
    return ckpt


def test_a_first_try_starts_fresh_on_a_store_that_does_not_exist(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    t = Try.begin(store=url, key=KEY)
    assert t.exclude == frozenset() and "starting fresh" in t.reason
    assert t.env() == {"CAIRN_STORE": url, "CAIRN_KEY": str(KEY), "CAIRN_EXCLUDE_SEQS": ""}
    t.check()  # nothing to give up on


def test_outcomes_are_recorded_once_per_epoch_and_the_verdicts_follow_the_policy(
        tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    policy = ResumePolicy(max_error_retries=1, max_preemptions=1)
    first = Try.begin(store=url, key=KEY, policy=policy)
    ckpt = _train(first, 5)
    error = RuntimeError("the step's own bug")
    assert first.ended(error=error, ckpt=ckpt) is AfterTry.RETRY  # 1 error: within the budget
    first.ended(error=error, ckpt=ckpt)  # the same epoch again: no second record
    with open_store(url) as store:
        outcomes = store.records.outcomes(KEY)
    assert [(o.epoch, o.outcome.value) for o in outcomes] == [(ckpt.epoch, "failed")]
    assert "the step's own bug" in outcomes[0].detail["error"]

    second = Try.begin(store=url, key=KEY, policy=policy)
    assert "resuming from seq" in second.reason
    assert second.ended(error=Preempted("spot reclaimed", seq=9)) is AfterTry.RESCHEDULE
    assert second.ended(error=RuntimeError("again")) is AfterTry.STOP  # 2 errors > 1

    ckpt2 = _train(second, 6)
    second.ended(error=RuntimeError("again"), ckpt=ckpt2)
    third = Try.begin(store=url, key=KEY, policy=policy)
    with pytest.raises(GaveUp, match="max_error_retries=1"):
        third.check()


@pytest.mark.isolated  # CRIU restores at fixed PIDs
def test_excluded_snapshots_reach_the_checkpointer_and_cairn_run(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    policy = ResumePolicy(resume_on="preemption")
    first = Try.begin(store=url, key=KEY, policy=policy)
    ckpt = _train(first, 5)
    first.ended(error=RuntimeError("bug"), ckpt=ckpt)

    second = Try.begin(store=url, key=KEY, policy=policy)
    assert ckpt.committed_seq in second.exclude
    assert second.env()["CAIRN_EXCLUDE_SEQS"] == ",".join(map(str, sorted(second.exclude)))
    argv = second.run_argv(["cairn"], ["python", "train.py"], every="10m", grace="30s")
    args = build_parser().parse_args(argv[1:])  # what cairn's own CLI makes of it
    assert args.exclude_seqs == second.env()["CAIRN_EXCLUDE_SEQS"] and args.key == str(KEY)
    resumed = second.checkpointer(every_steps=2, persist="inline")
    assert resumed.restore(model=torch.nn.Linear(2, 1)) == 0  # the excluded snapshot is not used
    resumed.close()

    second.finish(resumed)
    with open_store(url) as store:
        assert store.history(KEY)[-1].kind is RecordKind.DONE


def test_a_later_try_that_finds_no_try_in_the_store_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A vanished volume leaves its empty mount point: the store there opens as a new one
    (nothing tells it from a first try's), so a try after the first says so (ADR 0032)."""
    (tmp_path / "mnt").mkdir()
    store = str(tmp_path / "mnt" / "store")
    with caplog.at_level("WARNING", logger="cairn.tries"):
        Try.begin(store=store, key=KEY, try_number=1)
        assert caplog.records == []
        Try.begin(store=store, key=KEY, try_number=2)
    assert (f"this is try 2 of {KEY}, but the store {store} holds no try of it" in caplog.text
            and "a volume not mounted here" in caplog.text)
    # Without a try number (KFP), the line to print says both cases apart from its store.
    note = Try.begin(store=store, key=KEY).unnumbered_note()
    assert note is not None and f"the store {store} holds no try of {KEY}: a first try, or a " \
        "retry that does not see the store" in note
    _train(Try.begin(store=store, key=KEY), 3)  # now the store holds a try of the key
    caplog.clear()
    with caplog.at_level("WARNING", logger="cairn.tries"):
        later = Try.begin(store=store, key=KEY, try_number=2)
    assert caplog.records == [] and later.unnumbered_note() is None
