"""``cairn run`` end to end with real CRIU: snapshots of unmodified commands, kills, restores.

Every workload here knows nothing of cairn. Needs root and CRIU >= 4 (``make test`` builds it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cairn.process.pids import pid_max
from cairn.store import Key
from cairn import open_store
from tests.support.cairn_run import (
    COUNTER,
    CRIU,
    TRAINING,
    CairnRun,
    can_run_criu,
    descendants,
    gone,
    kill_after_commits,
    metric_steps,
    wait_for,
)
from tests.support.tamper import flip_byte

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]


@pytest.fixture()
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    # The step runs in tmp_path (CairnRun's default cwd), so the files it appends to under
    # workspace/ are inside its working directory, a track root (issue 15).
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "workspace"
    work.mkdir()
    return {"store": tmp_path / "store", "work": work, "cairn": work / "cairn",
            "logs": tmp_path / "logs", "metrics": work / "metrics.txt"}


def _counter(place: dict[str, Path], steps: int, pause: float = 0.05, **kw) -> CairnRun:
    store = kw.pop("store", str(place["store"]))
    return CairnRun(store=store, key=kw.pop("key", "dag/task/1"),
                    command=[sys.executable, str(COUNTER), str(place["metrics"]), str(steps),
                             str(pause)],
                    workdir=place["cairn"], logs=place["logs"], **kw)


def _after_a_snapshot(run: CairnRun, *, min_steps: int, metrics: Path, count: int = 1) -> None:
    """Wait until the workload did ``min_steps`` steps and ``count`` snapshots were taken after
    that. A dump under way when the steps were reached may have frozen the workload before
    them (a CI run restored one taken at step 0) and commits first: the supervisor dumps one at
    a time, so the ``count`` after it began after the steps."""
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= min_steps,
             120, f"{min_steps} steps")
    before = len(run.committed())
    wait_for(lambda: len(run.committed()) >= before + 1 + count or run.proc.poll() is not None,
             120, "a snapshot")
    assert run.proc.poll() is None, run.stderr


def _restores(place: dict[str, Path], seq: int, **kw) -> None:
    """Start the counter's run again: it must restore snapshot ``seq``; then kill it."""
    run = _counter(place, 100000, **kw)
    try:
        wait_for(lambda: "restored snapshot" in run.stderr or run.proc.poll() is not None,
                 60, "the restore")
        assert f"restored snapshot seq {seq} " in run.stderr, run.stderr
    finally:
        run.kill()


def test_killed_training_resumes_from_its_snapshot_bit_identical(place: dict[str, Path]) -> None:
    """DataLoader(num_workers=2, shuffle), a metrics file in append mode, stdout logging; the
    supervisor is SIGKILLed after a snapshot and a second run resumes mid-training."""
    steps = 240
    shm_before = torch_shm_files()
    reference_metrics, reference = place["work"] / "ref-metrics.txt", place["work"] / "ref.bin"
    subprocess.run([sys.executable, str(TRAINING), "--steps", str(steps), "--metrics",
                    str(reference_metrics), "--out", str(reference), "--sleep", "0"],
                   check=True, stdout=subprocess.DEVNULL, timeout=300)
    out = place["work"] / "weights.bin"
    command = [sys.executable, str(TRAINING), "--steps", str(steps), "--metrics",
               str(place["metrics"]), "--out", str(out), "--sleep", "0.05"]
    first = CairnRun(store=str(place["store"]), key="train/run-1", command=command,
                     workdir=place["cairn"], logs=place["logs"], every="2s")
    try:
        _after_a_snapshot(first, min_steps=20, metrics=place["metrics"])
        tree = descendants(first.proc.pid)
        assert len(tree) >= 3, "the trainer and its two DataLoader workers"
        done_before_kill = len(metric_steps(place["metrics"]))
    finally:
        first.kill()
    wait_for(lambda: all(gone(p) for p in tree), 30, "the workload to die with its supervisor")
    assert done_before_kill < steps

    second = CairnRun(store=str(place["store"]), key="train/run-1", command=command,
                      workdir=place["cairn"], logs=place["logs"], every="2s")
    assert second.wait(300) == 0, second.stderr
    assert "restored snapshot seq" in second.stderr, second.stderr
    resumed_at = int(re.search(r"step (\d+)", second.stdout).group(1))
    assert resumed_at > 0, "resumed mid-training, not from step 0"
    # Each step exactly once (the metrics file was cut back to its size at the snapshot) and
    # the same losses and final weights as a run that was never interrupted.
    got, want = place["metrics"].read_text().splitlines(), reference_metrics.read_text().splitlines()
    first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, (f"{len(got)} vs {len(want)} lines; first difference at line "
                         f"{first_diff}: {got[first_diff:first_diff + 2] if first_diff is not None else ''}"
                         f" vs {want[first_diff:first_diff + 2] if first_diff is not None else ''}\n"
                         f"{first.stderr}\n{second.stderr}")
    assert out.read_bytes() == reference.read_bytes()
    with open_store(str(place["store"]), create=False) as store:
        assert store.snapshots(Key.parse("train/run-1")) == [], "done: snapshots dropped"
    # The restore put back only the shared-memory files the workers were creating at the dump
    # (each unlinks its own), none that CRIU restored itself: nothing is left in /dev/shm.
    assert torch_shm_files() == shm_before, second.stderr


def torch_shm_files() -> list[str]:
    """torch's shared-memory files in this test's /dev/shm (the isolated lane's own)."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("torch_"))


def test_sigterm_with_budget_takes_a_final_snapshot_and_loses_no_step(
        place: dict[str, Path]) -> None:
    run = _counter(place, 400)
    _after_a_snapshot(run, min_steps=10, metrics=place["metrics"])
    run.signal(signal.SIGTERM)
    assert run.wait() == 75, run.stderr
    final = int(re.search(r"final snapshot seq (\d+) committed", run.stderr).group(1))
    at_kill = metric_steps(place["metrics"])
    assert run.snapshots()[0] == final

    again = _counter(place, 400)
    assert again.wait() == 0, again.stderr
    assert f"restored snapshot seq {final}" in again.stderr
    # The restored process continues with the very next step: none lost, none repeated.
    assert int(re.search(r"step (\d+)", again.stdout).group(1)) == at_kill[-1] + 1
    assert metric_steps(place["metrics"]) == list(range(400))
    # Each try left its outcome record: preempted (with its final snapshot), then succeeded.
    with open_store(str(place["store"]), create=False) as store:
        first, second = store.records.outcomes(Key.parse("dag/task/1"))
    assert (first.outcome.value, first.progress.snapshot_seq) == ("preempted", final)
    assert first.detail["signal"] == "SIGTERM" and first.detail["exit_code"] == 75
    assert (second.outcome.value, second.detail["resumed_from_seq"]) == ("succeeded", final)
    assert second.epoch > first.epoch


def test_a_restored_try_budgets_its_first_final_snapshot_by_what_the_restored_one_took(
        place: dict[str, Path]) -> None:
    """Before a try measured a snapshot of its own, its final snapshot's expected cost comes
    from the rate the restored snapshot was taken at (its dump and ingest seconds, in its
    metadata), not from the fixed conservative rate a brand-new key has to use."""
    run = _counter(place, 100000)
    _after_a_snapshot(run, min_steps=10, metrics=place["metrics"])
    kill_after_commits(run, len(run.committed()))
    seq = run.committed()[-1]
    with open_store(str(place["store"]), create=False) as store:
        info = store.manifest(Key.parse("dag/task/1"), seq).metadata["user"]["process"]
    assert info["dump_s"] > 0 and info["ingest_s"] > 0 and info["image_bytes"] > 0, info
    again = _counter(place, 100000, every="3600s")
    wait_for(lambda: "restored snapshot" in again.stderr or again.proc.poll() is not None,
             60, "the restore")
    again.signal(signal.SIGTERM)
    assert again.wait() == 75, again.stderr
    found = re.search(r"final snapshot seq \d+ committed in [0-9.]+s \(expected [0-9.]+s: no "
                      r"snapshot measured in this try; \d+ MB resident at the (\d+) MB/s the "
                      r"restored seq (\d+) took is about\)", again.stderr)
    assert found, again.stderr
    rate = info["image_bytes"] / (info["dump_s"] + info["ingest_s"])
    assert (int(found.group(1)), int(found.group(2))) == (round(rate / 1e6), seq)


def test_a_workload_killed_just_before_its_run_is_signalled_ends_preempted_not_failed(
        place: dict[str, Path]) -> None:
    """SLURM signals every process of the step, the workload included, in no set order: the
    workload dead of SIGTERM a moment before cairn run's own SIGTERM arrives is a preemption
    with the last snapshot kept (76), not a failure of the workload (143); the next run
    resumes from that snapshot."""
    run = _counter(place, 100000)
    _after_a_snapshot(run, min_steps=10, metrics=place["metrics"])
    child = run.child_pid()
    assert child is not None, run.stderr
    os.kill(child, signal.SIGTERM)
    time.sleep(0.05)  # the workload is gone before the run hears of the stop
    run.signal(signal.SIGTERM)
    assert run.wait() == 76, run.stderr
    assert "the workload ended with 143, signalled with this run" in run.stderr, run.stderr
    kept = run.committed()[-1]
    with open_store(str(place["store"]), create=False) as store:
        (outcome,) = store.records.outcomes(Key.parse("dag/task/1"))
    assert outcome.outcome.value == "preempted" and outcome.detail["exit_code"] == 76, outcome
    _restores(place, kept)


def test_a_suspend_request_stops_the_run_with_a_final_snapshot_and_resume_continues(
        place: dict[str, Path]) -> None:
    """``cairn suspend`` mid-run: a final dump, exit 77, outcome ``suspended``; a run started
    while the key is held stops before it starts; after ``cairn resume`` the next run
    continues at the very next step."""
    key, steps = Key.parse("dag/task/1"), 120
    poll = {"CAIRN_SUSPEND_POLL": "0.2s"}
    run = _counter(place, steps, every="10m", env=poll)
    wait_for(lambda: place["metrics"].exists() and len(metric_steps(place["metrics"])) >= 10
             or run.proc.poll() is not None, 120, "10 steps")
    assert run.proc.poll() is None, run.stderr
    with open_store(str(place["store"]), create=False) as store:
        ask = store.records.request_suspend(key, by="ops@example", reason="urgent job")
        asked = time.monotonic()
        assert run.wait() == 77, run.stderr
        exited = time.monotonic() - asked
        committed = re.search(r"\(([\d.]+)s after the request\)", run.stderr).group(1)
        print(f"process-mode suspend latency (poll 0.2 s): final snapshot committed "
              f"{committed}s after the request, cairn run exited after {exited:.2f}s")
        final = int(re.search(r"final snapshot seq (\d+) holds", run.stderr).group(1))
        at_stop = metric_steps(place["metrics"])
        assert run.snapshots()[0] == final and len(at_stop) < steps
        (outcome,) = store.records.outcomes(key)
        assert (outcome.outcome.value, outcome.detail["exit_code"]) == ("suspended", 77)
        assert outcome.detail["suspend"]["by"] == "ops@example"
        assert outcome.progress.snapshot_seq == final
        # What the try did, from cairn run's own counters (docs/adr/0031).
        summary = outcome.summary
        assert summary is not None and summary.last_seq == final
        assert summary.snapshots == len(run.snapshots()) and summary.stall_s > 0
        assert summary.bytes_written > 0 and summary.complete
        assert gone(run.child_pid())
        seqs = store.log(key).seqs()

        held = _counter(place, steps, env=poll)
        assert held.wait() == 77, held.stderr
        assert "is suspended" in held.stderr and "urgent job" in held.stderr
        assert store.log(key).seqs() == seqs, "a held key opens no attempt"
        assert metric_steps(place["metrics"]) == at_stop

        assert store.records.request_resume(key, by="ops@example").epoch == ask.epoch
    resumed = _counter(place, steps, env=poll)
    assert resumed.wait() == 0, resumed.stderr
    assert f"restored snapshot seq {final}" in resumed.stderr
    assert int(re.search(r"step (\d+)", resumed.stdout).group(1)) == at_stop[-1] + 1
    assert metric_steps(place["metrics"]) == list(range(steps)), "each step exactly once"


def test_sigterm_without_budget_keeps_the_previous_snapshot(place: dict[str, Path]) -> None:
    run = _counter(place, 400, grace="0")
    _after_a_snapshot(run, min_steps=10, metrics=place["metrics"])
    run.signal(signal.SIGTERM)
    assert run.wait() == 76, run.stderr
    kept = run.committed()[-1]
    assert "no final snapshot" in run.stderr and f"snapshot seq {kept} kept" in run.stderr
    assert run.snapshots()[0] == kept
    with open_store(str(place["store"]), create=False) as store:
        (outcome,) = store.records.outcomes(Key.parse("dag/task/1"))
    assert (outcome.outcome.value, outcome.detail["exit_code"]) == ("preempted", 76)
    assert outcome.progress.snapshot_seq == kept
    assert gone(run.child_pid())


def test_a_final_dump_that_outlasts_the_budget_is_killed_and_the_previous_snapshot_kept(
        place: dict[str, Path]) -> None:
    assert CRIU is not None
    # A FAKE hang: periodic dumps are real; the final one (no --leave-running) never returns.
    wrapper = place["work"] / "criu-hangs-on-the-final-dump"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then case " $* " in '
                       f'*" --leave-running "*) ;; *) exec sleep 600;; esac; fi\n'
                       f'exec {CRIU} "$@"\n')
    wrapper.chmod(0o755)
    run = _counter(place, 400, env={"CAIRN_CRIU": str(wrapper)}, grace="3s")
    _after_a_snapshot(run, min_steps=10, metrics=place["metrics"])
    run.signal(signal.SIGTERM)
    assert run.wait(60) == 76, run.stderr  # not the 900 s a periodic dump may take
    kept = run.committed()[-1]
    killed = re.search(r"criu dump did not finish within [1-3]s \(killed\)", run.stderr)
    assert killed, run.stderr
    assert f"the final snapshot failed; snapshot seq {kept} kept" in run.stderr, run.stderr
    assert run.snapshots()[0] == kept
    assert gone(run.child_pid())


def test_supervisor_sigkill_takes_fresh_and_restored_workloads_down(
        place: dict[str, Path]) -> None:
    first = _counter(place, 100000)
    _after_a_snapshot(first, min_steps=5, metrics=place["metrics"])
    child = first.child_pid()
    first.kill()
    wait_for(lambda: gone(child), 10, "the fresh workload to die with its supervisor")

    second = _counter(place, 100000)
    wait_for(lambda: "restored snapshot" in second.stderr or second.proc.poll() is not None, 60,
             "the restore")
    restored = second.child_pid()
    assert restored == child, "CRIU restores the same PID"
    assert restored in descendants(second.proc.pid), "the restored workload is the supervisor's child"
    second.kill()
    wait_for(lambda: gone(restored), 10, "the restored workload to die with its supervisor")


def test_another_machine_restores_from_gcs_with_the_workspace_gone(
        place: dict[str, Path], gcs_bucket: str) -> None:
    url = f"gs://{gcs_bucket}/cairn"
    # An unencrypted bucket: root restores from it only with the documented opt-out (the
    # encrypted case, without it: tests/integration/process/test_encrypted_run.py).
    opt_out = {"CAIRN_ALLOW_UNAUTHENTICATED_RESTORE": "1"}
    first = _counter(place, 300, store=url, env=opt_out)
    _after_a_snapshot(first, min_steps=20, metrics=place["metrics"])
    first.kill()
    wait_for(lambda: gone(first.child_pid()), 10, "the workload to die")
    kept = first.snapshots()[0]
    shutil.rmtree(place["work"])  # logs, staging, the metrics file: a fresh node has none

    second = _counter(place, 300, store=url, env=opt_out)
    assert second.wait() == 0, second.stderr
    assert f"restored snapshot seq {kept}" in second.stderr
    steps = metric_steps(place["metrics"])
    assert steps == list(range(300)), "the metrics file came back from the store, then grew"
    assert (place["cairn"]).exists()


def test_corrupt_newest_snapshot_falls_back_to_the_previous_one(place: dict[str, Path]) -> None:
    from cairn.store.url import open_backend

    first = _counter(place, 100000)
    _after_a_snapshot(first, min_steps=5, metrics=place["metrics"], count=2)
    first.kill()
    wait_for(lambda: gone(first.child_pid()), 10, "the workload to die")
    with open_store(str(place["store"]), create=False) as store:
        snaps = store.snapshots(Key.parse("dag/task/1"))
        newest, previous = snaps[0].manifest, snaps[1].manifest
        fresh = {c.pack for c in newest.chunk_refs()} - {c.pack for c in previous.chunk_refs()}
        victim = next(c for c in newest.chunk_refs() if c.pack in fresh)
    backend = open_backend(str(place["store"]))
    flip_byte(backend, victim.pack, victim.offset)
    backend.close()

    # This machine saw seq newest commit: the older one is a rollback, refused (ADR 0049)...
    refused = _counter(place, 100000)
    assert refused.wait(60) == 9, refused.stderr
    assert f"a try committed snapshot seq {newest.seq}; the newer snapshots failed their " \
        "checks" in refused.stderr and f"the next is seq {previous.seq}" in refused.stderr
    assert "--allow-rollback or CAIRN_ALLOW_ROLLBACK=1" in refused.stderr
    # ...unless allowed.
    second = _counter(place, 100000, env={"CAIRN_ALLOW_ROLLBACK": "1"})
    try:
        wait_for(lambda: "restored snapshot" in second.stderr or second.proc.poll() is not None,
                 60, "the restore")
        assert f"skipping snapshot seq {newest.seq}" in second.stderr, second.stderr
        assert f"restored snapshot seq {previous.seq}" in second.stderr, second.stderr
        wait_for(lambda: len(metric_steps(place["metrics"])) > 5, 30, "progress")
        steps = metric_steps(place["metrics"])
        assert steps == list(range(len(steps))), "cut back to the older snapshot: no repeats"
    finally:
        second.kill()


def test_excluded_snapshots_are_not_restored(place: dict[str, Path]) -> None:
    """--exclude-seqs (here through $CAIRN_EXCLUDE_SEQS, as the Airflow operator's resume
    policy passes it): the newest snapshot is passed over for the one before it."""
    first = _counter(place, 100000)
    _after_a_snapshot(first, min_steps=5, metrics=place["metrics"], count=2)
    first.kill()
    wait_for(lambda: gone(first.child_pid()), 10, "the workload to die")
    with open_store(str(place["store"]), create=False) as store:
        newest, previous = [i.seq for i in store.snapshots(Key.parse("dag/task/1"))[:2]]
    _restores(place, previous, env={"CAIRN_EXCLUDE_SEQS": str(newest)})
    with open_store(str(place["store"]), create=False) as store:
        assert store.records.tries(Key.parse("dag/task/1"))[-1].resumed_from == previous


def test_changed_script_or_host_record_starts_fresh_saying_why(place: dict[str, Path]) -> None:
    script = place["work"] / "job.py"
    shutil.copy(COUNTER, script)
    command = [sys.executable, str(script), str(place["metrics"]), "100000"]
    first = CairnRun(store=str(place["store"]), key="k", command=command,
                     workdir=place["cairn"], logs=place["logs"])
    _after_a_snapshot(first, min_steps=5, metrics=place["metrics"])
    first.kill()
    wait_for(lambda: gone(first.child_pid()), 10, "the workload to die")

    script.write_text(script.read_text() + "\n# fixed a bug\n")
    second = CairnRun(store=str(place["store"]), key="k", command=command,
                      workdir=place["cairn"], logs=place["logs"])
    wait_for(lambda: "started" in second.stderr, 60, "a fresh start")
    assert re.search(r"starting fresh: snapshot seq \d+ does not fit: .*job.py changed",
                     second.stderr), second.stderr
    _after_a_snapshot(second, min_steps=3, metrics=place["metrics"])
    second.kill()
    wait_for(lambda: gone(second.child_pid()), 10, "the workload to die")

    third = CairnRun(store=str(place["store"]), key="k", command=command,
                     workdir=place["cairn"], logs=place["logs"],
                     env={"CAIRN_IMAGE_DIGEST": "sha256:" + "ab" * 32})
    wait_for(lambda: "started" in third.stderr, 60, "a fresh start")
    third.kill()
    assert "container image differs" in third.stderr, third.stderr


def test_failing_or_vanishing_criu_leaves_training_running(place: dict[str, Path]) -> None:
    assert CRIU is not None
    wrapper = place["work"] / "criu-wrapper"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then echo "simulated dump failure" >&2; '
                       f'exit 1; fi\nexec {CRIU} "$@"\n')
    wrapper.chmod(0o755)
    run = _counter(place, 60, env={"CAIRN_CRIU": str(wrapper)}, every="0.5s")
    wait_for(lambda: "snapshot failed" in run.stderr or run.proc.poll() is not None, 60,
             "a failed dump")
    assert run.wait() == 0, run.stderr
    assert "snapshot failed (the workload keeps running)" in run.stderr
    assert "simulated dump failure" in run.stderr
    assert metric_steps(place["metrics"]) == list(range(60))

    place["metrics"].unlink()
    vanishing = place["work"] / "criu-link"
    vanishing.symlink_to(CRIU)
    run = _counter(place, 80, env={"CAIRN_CRIU": str(vanishing)}, every="0.5s")
    wait_for(lambda: "started" in run.stderr, 60, "the start")
    vanishing.unlink()  # CRIU disappears while the step runs
    assert run.wait() == 0, run.stderr
    assert "does not exist" in run.stderr
    assert metric_steps(place["metrics"]) == list(range(80))


def test_unsnapshottable_workloads_are_named(place: dict[str, Path]) -> None:
    rewritten = place["work"] / "rewritten.py"
    rewritten.write_text(
        "import sys, time\nf = open(sys.argv[1], 'w')\n"
        "for i in range(40):\n    f.write(f'{i}\\n'); f.flush(); time.sleep(0.05)\n")
    target = place["work"] / "state.txt"
    run = CairnRun(store=str(place["store"]), key="w", command=[sys.executable, str(rewritten),
                                                                 str(target)],
                   workdir=place["cairn"], logs=place["logs"], every="0.5s")
    assert run.wait() == 0, run.stderr
    assert f"holds {target} open for writing without append mode" in run.stderr
    assert "open it with mode 'a'" in run.stderr

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    client = place["work"] / "client.py"
    client.write_text("import socket, sys, time\n"
                      "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
                      "time.sleep(2.5)\n")
    run = CairnRun(store=str(place["store"]), key="t", command=[sys.executable, str(client),
                                                                 str(port)],
                   workdir=place["cairn"], logs=place["logs"], every="0.5s")
    assert run.wait() == 0, run.stderr
    assert "established TCP connection 127.0.0.1:" in run.stderr
    assert f"-> 127.0.0.1:{port}" in run.stderr
    server.close()


def test_success_marks_done_unless_keep(place: dict[str, Path]) -> None:
    run = _counter(place, 30, key="a", every="0.3s")
    assert run.wait() == 0, run.stderr
    assert run.committed(), "it took snapshots while running"
    with open_store(str(place["store"]), create=False) as store:
        assert store.snapshots(Key.parse("a")) == []
        assert store.history(Key.parse("a"))[-1].kind.value == "done"
    place["metrics"].unlink()
    kept = _counter(place, 30, key="b", every="0.3s", extra=["--keep"])
    assert kept.wait() == 0, kept.stderr
    assert kept.snapshots(), "--keep leaves the snapshots"


def test_preflight_fails_fast_naming_what_is_missing(place: dict[str, Path]) -> None:
    run = _counter(place, 5, env={"CAIRN_CRIU": str(place["work"] / "no-such-criu")})
    assert run.wait() == 7, run.stderr
    assert "no-such-criu" in run.stderr
    assert not place["metrics"].exists(), "nothing started"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_restore_in_a_fresh_pid_namespace_with_a_decoy_on_low_pids(place: dict[str, Path]) -> None:
    """A fresh pod stands in as ``unshare --pid --fork --mount-proc``: PIDs start at 1 there.
    The workload is started high in the PID space, so decoys holding the low PIDs a fresh
    namespace hands out do not collide with the restore."""
    fresh_ns = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    first = _counter(place, 100000, prefix=fresh_ns)
    _after_a_snapshot(first, min_steps=5, metrics=place["metrics"])
    child = first.child_pid()
    assert child is not None and child >= pid_max() // 2, f"started at a high PID, not {child}"
    namespace = descendants(first.proc.pid)
    first.kill()  # unshare's --kill-child takes the whole namespace down
    wait_for(lambda: all(gone(p) for p in namespace), 30, "the first namespace to die")

    decoys = "for i in $(seq 1 64); do sleep 300 & done; exec \"$@\""  # PIDs 2..65
    second = _counter(place, 100000, prefix=[*fresh_ns, "sh", "-c", decoys, "sh"])
    try:
        wait_for(lambda: "restored snapshot" in second.stderr or second.proc.poll() is not None,
                 60, "the restore")
        assert f"(pid {child})" in second.stderr, second.stderr
        steps_before = len(metric_steps(place["metrics"]))
        wait_for(lambda: len(metric_steps(place["metrics"])) > steps_before + 3, 30,
                 "the restored workload to make progress")
    finally:
        second.kill()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_read_only_proc_sys_is_made_writable_for_the_workload_only(place: dict[str, Path]) -> None:
    """Containers mount /proc/sys read-only; the supervisor remounts it writable in a private
    mount namespace so the workload still starts at a high PID."""
    read_only = ("mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && "
                 "exec \"$@\"")
    run = _counter(place, 40, prefix=["unshare", "--mount", "sh", "-c", read_only, "sh"])
    assert run.wait() == 0, run.stderr
    assert "remounted writable in a private mount namespace" in run.stderr, run.stderr
    child = run.child_pid()
    assert child is not None and child >= pid_max() // 2, run.stderr
