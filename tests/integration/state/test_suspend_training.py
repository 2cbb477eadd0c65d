"""Real torch training suspended on request mid-run (``Store.records.request_suspend``, as ``cairn
suspend`` asks): a final snapshot at the next step, exit 77, outcome ``suspended``; no try
starts while the key is held; after a resume every step runs exactly once, bit-identical to a
run never suspended."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from cairn.runtime import env
from cairn.runtime.exits import ExitCode
from cairn.store import Key
from cairn import open_store
from cairn.store.outcomes import OutcomeKind
from tests.support.hang import HANG_S
from tests.support.resume_runs import finish, losses, same_weights, start

TINY = "tests.support.tiny_training"
KEY = "dag/train/run-1/0"
TOTAL = 60


def _train(store: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    return start(TINY, str(store), KEY, str(out), "--total", str(TOTAL), "--every", "20", *extra)


@pytest.mark.slow
def test_a_suspended_run_takes_a_final_snapshot_and_resumes_every_step_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.SUSPEND_POLL.name, "0.1s")
    ref_losses = losses(finish(_train(tmp_path / "ref-store", tmp_path / "ref.pt")))
    key = Key.parse(KEY)

    # 0.1 s per step: the request arrives long before the run could end by itself.
    victim = _train(tmp_path / "store", tmp_path / "victim.pt", "--pace", "0.1")
    assert victim.stdout is not None
    seen: list[str] = []
    store = open_store(str(tmp_path / "store"))
    try:
        for line in victim.stdout:
            seen.append(line.strip())
            if line.startswith("loss 5 "):
                store.records.request_suspend(key, by="ops@example", reason="urgent job")
                asked = time.monotonic()
                break
        seen += [line.strip() for line in victim.stdout]
        victim.wait(timeout=HANG_S)
        exited = time.monotonic() - asked
        committed = next(m[1] for line in seen
                         if (m := re.search(r"\(([\d.]+)s after the request\)", line)))
        print(f"state-mode suspend latency (poll 0.1 s, 0.1 s steps): final snapshot committed "
              f"{committed}s after the request, script exited after {exited:.2f}s")
        assert victim.returncode == ExitCode.SUSPENDED, seen[-5:]
        last = max(losses(seen))
        assert 5 <= last < TOTAL - 1
        assert store.manifest(key).step == last, "the final snapshot holds the last step"
        (outcome,) = store.records.outcomes(key)
        assert outcome.outcome is OutcomeKind.SUSPENDED
        assert outcome.detail["suspend"]["by"] == "ops@example"
        assert outcome.progress.kept_step == last
        # (A try started while the key is held: test_checkpointer_suspend.py.)
        store.records.request_resume(key, by="ops@example")
    finally:
        store.close()
    resumed = finish(_train(tmp_path / "store", tmp_path / "victim.pt"))
    assert f"start {last + 1}" in resumed
    before, after = losses(seen), losses(resumed)
    assert sorted([*before, *after]) == list(range(TOTAL)), "each step exactly once"
    assert {**before, **after} == ref_losses, "the resumed run diverged"
    same_weights(tmp_path / "ref.pt", tmp_path / "victim.pt")
