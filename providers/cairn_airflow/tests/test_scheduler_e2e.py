"""End to end with a real Airflow scheduler: a task's process is SIGKILLed mid-run, Airflow
retries it, and the retry resumes from the last snapshot instead of step 0.

One stack (api-server, scheduler, dag-processor; LocalExecutor, SQLite) serves the module's
tests; it runs the example DAGs of the repository's ``dags/`` folder. Each DAG's workload
appends ``<pid> <step> <unix time>`` to a progress log after every step (opened per line, so a
process snapshot does not carry it): what really ran, including work redone after a resume.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cairn_airflow.local_stack import AirflowStack, commits_after
from cairn_airflow.resume import MIN_RESCHEDULE_DELAY

# One stack serves the module: its tests run on one xdist worker (make test: --dist loadfile).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SUSPEND_POLL_S = 0.2


@pytest.fixture(scope="module")
def stack() -> Iterator[AirflowStack]:
    root = Path(tempfile.mkdtemp(prefix="cairn-af-stack-"))
    # The triggerer runs (a suspended task waits there); tries look for suspend requests and
    # deferred tasks for resumes every 0.2 s, so the suspend tests stay short.
    s = AirflowStack(root / "home", REPO / "dags", store=root / "store", triggerer=True,
                     env={"CAIRN_SUSPEND_POLL": f"{SUSPEND_POLL_S}s",
                          # A task marked failed in the UI learns it at its next heartbeat.
                          "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1"})
    try:
        s.start()
        yield s
    finally:
        s.stop()
        shutil.rmtree(root, ignore_errors=True)


def read_progress(path: Path) -> list[tuple[int, int, float]]:
    rows = []
    for line in path.read_text().splitlines():
        pid, step, at = line.split()
        rows.append((int(pid), int(step), float(at)))
    return rows


def resume_point(rows: list[tuple[int, int, float]], *, after: float) -> tuple[int, int]:
    """(index of the first row after the resume, the last step the first life reached): the
    first row written after ``after``, a time by which the first life had stopped writing.
    A boundary in time, not the longest pause: a loaded CI host once paused a first life for
    23.6 s, longer than its freeze-to-restore."""
    for i in range(1, len(rows)):
        if rows[i][2] > after:
            return i, rows[i - 1][1]
    raise AssertionError(f"the progress log shows no row after the first life: steps "
                         f"{rows[0][1]}..{rows[-1][1]}, the last at {rows[-1][2]:.3f}, "
                         f"the first life over by {after:.3f}")


def _first_life_ended(stack: AirflowStack, progress: Path) -> float:
    """When the workload process that wrote the last progress row was seen gone; polled every
    10 ms, well inside the retry delay, so a restore reusing its PID (CRIU) is not mistaken
    for it."""
    workload_pid = read_progress(progress)[-1][0]
    stack.wait_for(lambda: _gone(workload_pid), what=f"workload {workload_pid} to end",
                   timeout=30, every=0.01)
    return time.time()


def _snapshots(store: Path, key: tuple[str, ...]) -> list:  # noqa: ANN001
    from cairn.store import Key
    from cairn import open_store

    if not (store / "cairn-store.json").exists():
        return []
    with open_store(str(store), create=False) as s:
        return s.snapshots(Key(key))


def _newest_seq(store: Path, key: tuple[str, ...]) -> int:
    return max((info.seq for info in _snapshots(store, key)), default=-1)


def _kill_task_process(stack: AirflowStack, dag_id: str, run_id: str) -> int:
    ti = stack.task_instance(dag_id, run_id, "train")
    assert ti["state"] == "running" and ti["pid"], ti
    os.kill(ti["pid"], signal.SIGKILL)
    return ti["pid"]


def test_a_killed_cooperative_task_resumes_from_its_snapshot(stack: AirflowStack,
                                                            tmp_path: Path) -> None:
    dag_id, every = "cairn_cooperative_training", 100  # EVERY_STEPS in the DAG file
    progress = tmp_path / "progress.log"
    run_id = stack.trigger(dag_id, {"total_steps": 600, "step_seconds": 0.01,
                                    "progress_log": str(progress)})
    key = (dag_id, "train", run_id, "-1")
    stack.wait_for(lambda: any((i.manifest.step or 0) >= every for i in _snapshots(stack.store, key)),
                   what="a committed snapshot past the first interval", timeout=120)
    _kill_task_process(stack, dag_id, run_id)
    first_life_ended = _first_life_ended(stack, progress)
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()

    result = stack.xcom(dag_id, run_id, "train")
    meta = stack.xcom(dag_id, run_id, "train", "cairn")
    rows = read_progress(progress)
    index, reached = resume_point(rows, after=first_life_ended)
    assert result["start_step"] > 0 and result["end_step"] == 600
    assert rows[index][1] == result["start_step"]
    assert rows[index][0] != rows[index - 1][0], "the resumed steps ran in the same process"
    redone = reached - result["start_step"] + 1
    assert 0 <= redone <= every, f"redid {redone} steps; snapshots are {every} apart"
    assert meta["resumed_step"] == result["start_step"] - 1 and meta["done"] is True
    assert meta["try_number"] == 2
    assert [r[1] for r in rows[index:]] == list(range(result["start_step"], 600))


def _wait_steps(stack: AirflowStack, progress: Path, steps: int) -> None:
    stack.wait_for(lambda: progress.exists() and len(progress.read_text().splitlines()) >= steps,
                   what=f"{steps} steps", timeout=300)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it died between open and read
        return True


def _outcomes(store: Path, key: tuple[str, ...]) -> list:  # noqa: ANN001
    from cairn.store import Key
    from cairn import open_store

    with open_store(str(store), create=False) as s:
        return s.records.outcomes(Key(key))


def test_mark_failed_takes_a_final_snapshot_and_clear_resumes_after_it(stack: AirflowStack,
                                                                      tmp_path: Path) -> None:
    """The UI's "mark failed": SIGTERM to the task's group, SIGKILL 5 s later. The next
    ckpt.step() snapshots within that budget; "clear" then resumes right after it."""
    dag_id = "cairn_cooperative_training"
    progress = tmp_path / "progress.log"
    run_id = stack.trigger(dag_id, {"total_steps": 3000, "step_seconds": 0.01,
                                    "progress_log": str(progress)})
    key = (dag_id, "train", run_id, "-1")
    _wait_steps(stack, progress, 150)
    pid = stack.task_instance(dag_id, run_id, "train")["pid"]
    stack.mark_failed(dag_id, run_id, "train")
    stack.wait_for(lambda: _gone(pid), what="the task's process to end", timeout=60)
    last_logged = read_progress(progress)[-1][1]
    final = _snapshots(stack.store, key)[0].manifest
    # step() snapshots the step it is called after, then raises before that step is logged.
    assert final.step in (last_logged, last_logged + 1), (final.step, last_logged)
    assert [o.outcome.value for o in _outcomes(stack.store, key)] == ["preempted"]

    # As a user sees it: the run fails, then "clear". A clear while the scheduler is still
    # failing the run can lose to it, and the run stays failed.
    assert stack.wait_for_run(dag_id, run_id) == "failed"
    stack.clear(dag_id, run_id, "train")
    # A CI run beside the other suites took over 300 s for the resumed try's 2,840 steps of
    # 10 ms: the wait is only a hang guard (RUN_HANG_S).
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()
    result = stack.xcom(dag_id, run_id, "train")
    assert result["start_step"] == final.step + 1
    assert [o.outcome.value for o in _outcomes(stack.store, key)] == ["preempted", "succeeded"]


def test_a_zombie_first_try_is_fenced_when_its_retry_starts(stack: AirflowStack,
                                                          tmp_path: Path) -> None:
    """The worker running the first try is SIGKILLed; the try's own process runs on. After the
    heartbeat timeout the scheduler starts try 2, whose attempt fences the first: it stops at
    its next snapshot, within one snapshot interval of steps."""
    from datetime import datetime

    from cairn.store import Key
    from cairn import open_store
    from cairn.store.slotlog import RecordKind

    dag_id, every = "cairn_cooperative_training", 100
    progress = tmp_path / "progress.log"
    run_id = stack.trigger(dag_id, {"total_steps": 4000, "step_seconds": 0.01,
                                    "progress_log": str(progress)})
    key = (dag_id, "train", run_id, "-1")
    _wait_steps(stack, progress, 150)
    pid = stack.task_instance(dag_id, run_id, "train")["pid"]
    with open(f"/proc/{pid}/stat") as f:
        worker = int(f.read().rsplit(")", 1)[1].split()[1])
    os.kill(worker, signal.SIGKILL)
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()
    stack.wait_for(lambda: _gone(pid), what="the zombie to stop", timeout=60)

    with open_store(str(stack.store), create=False) as s:
        opens = [r for r in s.history(Key(key)) if r.kind is RecordKind.OPEN]
    assert len(opens) == 2
    retry_opened = datetime.fromisoformat(opens[1].created_at.replace("Z", "+00:00")).timestamp()
    zombie_after = [r for r in read_progress(progress) if r[0] == pid and r[2] > retry_opened]
    assert len(zombie_after) <= every, f"the zombie ran {len(zombie_after)} steps after the " \
                                       f"retry's attempt opened; snapshots are {every} apart"
    outcomes = [o.outcome.value for o in _outcomes(stack.store, key)]
    assert outcomes == ["fenced", "succeeded"], outcomes


needs_criu = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("criu") is None and not os.access("/usr/local/sbin/criu", os.X_OK),
    reason="process mode needs root and CRIU (make criu)")


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@needs_criu
def test_a_killed_process_mode_task_resumes_the_process(stack: AirflowStack,
                                                        tmp_path: Path) -> None:
    dag_id, every_s = "cairn_process_training", 3.0
    progress = tmp_path / "progress.log"
    steps = 3000
    run_id = stack.trigger(dag_id, {"steps": steps, "step_seconds": 0.01, "every": f"{every_s:g}s",
                                    "progress_log": str(progress)})
    key = (dag_id, "train", run_id, "-1")
    # The first dumps may catch the script still importing torch: kill once it has trained a
    # while and a snapshot was taken after that.
    stack.wait_for(lambda: progress.exists() and len(progress.read_text().splitlines()) > 300,
                   what="300 steps", timeout=300)
    stack.wait_for(commits_after(lambda: (i.seq for i in _snapshots(stack.store, key)),
                                 _newest_seq(stack.store, key)),
                   what="a process snapshot taken after step 300", timeout=180)
    _kill_task_process(stack, dag_id, run_id)
    first_life_ended = _first_life_ended(stack, progress)
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()

    rows = read_progress(progress)
    index, reached = resume_point(rows, after=first_life_ended)
    resumed_at = rows[index][1]
    first_life = rows[:index]
    assert resumed_at > 0, "the retry started the script over"
    # The restored process is the same process (CRIU restores its PID) continuing from the
    # step it was dumped at: it redoes only what ran after that dump.
    assert rows[index][0] == first_life[-1][0]
    redone = [r for r in first_life if r[1] >= resumed_at]
    redone_s = redone[-1][2] - redone[0][2] if redone else 0.0
    assert redone_s <= every_s, f"redid {len(redone)} steps over {redone_s:.1f}s; " \
                                f"snapshots are {every_s:g}s apart"
    assert [r[1] for r in rows[index:]] == list(range(resumed_at, steps))
    meta = stack.xcom(dag_id, run_id, "train", "cairn")
    assert meta["exit_code"] == 0 and meta["done"] is True and meta["try_number"] == 2
    assert len(meta["epochs"]) >= 2
    log = stack.task_log(dag_id, run_id, "train", 2)
    assert f"done: {steps} steps" in log, log[-2000:]


def _process_training_past_300_steps(stack: AirflowStack, progress: Path,
                                     steps: int) -> tuple[str, tuple[str, ...]]:
    """Trigger the process-training DAG with no periodic snapshot (every 1 h) and wait until
    its script has trained 300 steps; returns the run id and the task's key."""
    dag_id = "cairn_process_training"
    run_id = stack.trigger(dag_id, {"steps": steps, "step_seconds": 0.01, "every": "1h",
                                    "progress_log": str(progress)})
    stack.wait_for(lambda: progress.exists() and len(progress.read_text().splitlines()) > 300,
                   what="300 steps", timeout=300)
    return run_id, (dag_id, "train", run_id, "-1")


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@needs_criu
def test_sigterm_to_a_process_mode_task_snapshots_and_reschedules_without_a_retry(
        stack: AirflowStack, tmp_path: Path) -> None:
    """SIGTERM to the task's process (as a node shutdown sends it): on_kill asks cairn run for
    a final snapshot, which fits the grace budget; cairn run exits 75 and, with
    max_preemptions=3, the task is rescheduled with the same try number and the process
    restored exactly where the final snapshot froze it."""
    dag_id, steps = "cairn_process_training", 2500
    progress = tmp_path / "progress.log"
    run_id, key = _process_training_past_300_steps(stack, progress, steps)
    ti = stack.task_instance(dag_id, run_id, "train")
    assert _snapshots(stack.store, key) == []  # every=1h: only the final snapshot will exist
    os.kill(ti["pid"], signal.SIGTERM)
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()

    outcomes = _outcomes(stack.store, key)
    assert [o.outcome.value for o in outcomes] == ["preempted", "succeeded"], \
        [(o.epoch, o.outcome.value, dict(o.detail)) for o in outcomes]
    preempted, succeeded = outcomes
    assert preempted.detail["signal"] == "SIGTERM" and preempted.detail["exit_code"] == 75
    final = preempted.progress.snapshot_seq
    assert final is not None and succeeded.detail["resumed_from_seq"] == final
    rows = read_progress(progress)
    # cairn run records the outcome after the final dump has ended the process.
    index, reached = resume_point(rows, after=preempted.ended_at)
    assert rows[index][1] == reached + 1, "the restored process redid or skipped steps"
    assert [r[1] for r in rows] == list(range(steps))
    ti = stack.task_instance(dag_id, run_id, "train")
    assert ti["try_number"] == 1, "the preemption consumed a retry"
    meta = stack.xcom(dag_id, run_id, "train", "cairn")
    assert meta["exit_code"] == 0 and meta["try_number"] == 1
    assert f"resuming from seq {final}" in meta["resume_plan"]


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@needs_criu
def test_mark_failed_on_a_process_mode_task_snapshots_and_clear_restores_it(
        stack: AirflowStack, tmp_path: Path) -> None:
    """The UI's "mark failed" on a process-mode task: SIGTERM to the task's group (cairn run
    is in a session of its own, so only on_kill reaches it), SIGKILL 5 s later. The final
    snapshot fits the 4 s grace; the task stays failed (a reschedule is refused for a task
    marked failed) and "clear" restores the process right after the snapshot."""
    dag_id, steps = "cairn_process_training", 4000
    progress = tmp_path / "progress.log"
    run_id, key = _process_training_past_300_steps(stack, progress, steps)
    pid = stack.task_instance(dag_id, run_id, "train")["pid"]
    asked_at = time.time()
    stack.mark_failed(dag_id, run_id, "train")
    stack.wait_for(lambda: _gone(pid), what="the task's process to end", timeout=60)
    stack.wait_for(lambda: len(_outcomes(stack.store, key)) == 1,
                   what="cairn run's outcome record", timeout=60)
    (preempted,) = _outcomes(stack.store, key)
    assert preempted.outcome.value == "preempted" and preempted.detail["exit_code"] == 75
    assert stack.task_instance(dag_id, run_id, "train")["state"] == "failed"
    last = read_progress(progress)[-1]
    stopped_at = last[1]
    # The kill reaches the task at the worker's next heartbeat (1 s in the stack) and the
    # final snapshot freezes it; the workload must not have run out of steps by then.
    assert stopped_at < steps - 1, (
        f"the workload finished (step {stopped_at}) {last[2] - asked_at:.1f}s after mark-failed "
        f"before the kill reached it\n{stack.logs_tail()}")

    assert stack.wait_for_run(dag_id, run_id) == "failed"  # then "clear"
    cleared_at = time.time()
    stack.clear(dag_id, run_id, "train")
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()
    rows = read_progress(progress)
    assert [r[1] for r in rows] == list(range(steps)), "steps were redone or skipped"
    # The process was gone before the clear: the restored one wrote every row after it,
    # starting with the step after the one the first life reached.
    index, reached = resume_point(rows, after=cleared_at)
    assert (reached, rows[index][1]) == (stopped_at, stopped_at + 1), (
        f"the first life reached step {stopped_at}; the rows around the clear are "
        f"{rows[max(index - 2, 0):index + 2]}")
    outcomes = _outcomes(stack.store, key)
    assert [o.outcome.value for o in outcomes] == ["preempted", "succeeded"]
    assert outcomes[1].detail["resumed_from_seq"] == preempted.progress.snapshot_seq


# -- suspend and resume (issue 19): the task defers, its process is gone, no retry is used ------

def _suspend_and_resume(stack: AirflowStack, dag_id: str, run_id: str, progress: Path,
                        *, key: tuple[str, ...], workload_pid: int | None) -> dict[str, float]:
    """Suspend through the page's API, see the task deferred with its processes gone, resume,
    see it continue; returns the measured seconds (request to deferred, resume to next step)."""
    ti = stack.task_instance(dag_id, run_id, "train")
    assert ti["state"] == "running" and ti["try_number"] == 1, ti
    task_pid = ti["pid"]
    asked_at = time.time()
    made = stack.cairn_request("suspend", dag_id, run_id, "train", reason="e2e: GPUs needed")
    assert made["suspension"]["state"] == "suspend-requested", made
    stack.wait_for(lambda: stack.task_instance(dag_id, run_id, "train")["state"] == "deferred",
                   what="the suspended task to be deferred", timeout=120, every=0.1)
    deferred_at = time.time()
    deferred_s = deferred_at - asked_at
    for pid in filter(None, (task_pid, workload_pid)):
        stack.wait_for(lambda pid=pid: _gone(pid), what=f"process {pid} to end", timeout=30)
    (outcome,) = [o for o in _outcomes(stack.store, key) if o.outcome.value == "suspended"]
    assert outcome.detail["suspend"]["by"].endswith("(Airflow)"), outcome.detail
    stopped_at = read_progress(progress)[-1][1]
    ti = stack.task_instance(dag_id, run_id, "train")
    assert ti["state"] == "deferred" and ti["try_number"] == 1, ti

    resumed_at = time.time()
    made = stack.cairn_request("resume", dag_id, run_id, "train", reason="e2e: done")
    assert made["suspension"]["state"] == "resume-requested", made
    stack.wait_for(lambda: read_progress(progress)[-1][1] > stopped_at,
                   what="the step after the suspend snapshot", timeout=180, every=0.1)
    next_at = time.time()
    rows = read_progress(progress)
    index = next(i for i, r in enumerate(rows) if r[1] > stopped_at)
    assert rows[index][1] == stopped_at + 1, "the resumed try redid or skipped steps"
    # The trigger holds a resume asked at once until MIN_RESCHEDULE_DELAY after the deferral.
    floor_at = max(resumed_at, deferred_at + MIN_RESCHEDULE_DELAY.total_seconds())
    print(f"\n{dag_id}: suspend request -> deferred {deferred_s:.2f}s; resume request -> "
          f"next step {next_at - resumed_at:.2f}s, {next_at - floor_at:.2f}s of it after the "
          f"deferral floor (step {stopped_at} -> {stopped_at + 1})")
    return {"deferred_s": deferred_s, "next_step_s": next_at - resumed_at}


def test_a_suspended_cooperative_task_defers_and_resumes_where_it_stopped(
        stack: AirflowStack, tmp_path: Path) -> None:
    dag_id, steps = "cairn_suspendable_training", 400
    progress = tmp_path / "progress.log"
    run_id = stack.trigger(dag_id, {"total_steps": steps, "step_seconds": 0.02,
                                    "progress_log": str(progress)})
    key = (dag_id, "train", run_id, "-1")
    _wait_steps(stack, progress, 40)
    _suspend_and_resume(stack, dag_id, run_id, progress, key=key, workload_pid=None)
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()

    assert [r[1] for r in read_progress(progress)] == list(range(steps)), \
        "a step was redone or skipped"
    assert stack.task_instance(dag_id, run_id, "train")["try_number"] == 1, "a retry was used"
    assert [o.outcome.value for o in _outcomes(stack.store, key)] == ["suspended", "succeeded"]
    result = stack.xcom(dag_id, run_id, "train")
    meta = stack.xcom(dag_id, run_id, "train", "cairn")
    assert result["start_step"] > 0 and meta["try_number"] == 1 and meta["done"] is True


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@needs_criu
def test_a_suspended_process_mode_task_defers_and_its_process_is_restored(
        stack: AirflowStack, tmp_path: Path) -> None:
    dag_id, steps = "cairn_process_training", 1500
    progress = tmp_path / "progress.log"
    run_id, key = _process_training_past_300_steps(stack, progress, steps)
    workload = read_progress(progress)[-1][0]
    _suspend_and_resume(stack, dag_id, run_id, progress, key=key, workload_pid=workload)
    assert stack.wait_for_run(dag_id, run_id) == "success", stack.logs_tail()

    rows = read_progress(progress)
    assert [r[1] for r in rows] == list(range(steps)), "a step was redone or skipped"
    assert {r[0] for r in rows} == {workload}, "the restored process is not the same process"
    assert stack.task_instance(dag_id, run_id, "train")["try_number"] == 1, "a retry was used"
    assert [o.outcome.value for o in _outcomes(stack.store, key)] == ["suspended", "succeeded"]
    meta = stack.xcom(dag_id, run_id, "train", "cairn")
    assert meta["exit_code"] == 0 and meta["try_number"] == 1 and meta["done"] is True
