"""Kueue eviction vs node drain, with the pod's containers as real processes (``cairn sidecar``
and ``cairn run`` sharing a directory, as the transformed Job pod's containers share their
volume) and a FAKE Kubernetes API server (none can run here) serving the owner Job.

Kueue evicts by setting the Job's ``spec.suspend: true``, then the pod gets SIGTERM as in a
drain; on SIGTERM ``cairn run`` asks the sidecar (``terminating.json``), which reads the Job
and answers (``cause.json``): suspended → exit 77 and the ``suspended`` outcome after the final
snapshot, and the readmitted Job's pod resumes from it; not suspended, or no RBAC grant (403)
→ exit 75 and ``preempted``, with the reason logged and recorded. State mode (a real torch
training script with the ``Checkpointer``) asks the same way: suspended → exit 77 and the
``suspended`` outcome; a drain is a preemption (exit 75). As in the transformed Job pod, both
containers keep their committed-seq files on the shared volume, which the sidecar seeds from
the Job's annotation before the main container starts (one ``GET``) and keeps in it
(``PATCH``es, counted apart)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.k8s.committed import ANNOTATION, STARTED_PATH, parse_entries
from cairn.runtime import channel
from cairn.store import Key
from cairn import open_store
from tests.integration.k8s.fakes import JOB, FakeKubernetesAPI
from tests.integration.k8s.test_sidecar import SidecarProcess
from tests.support.cairn_run import COUNTER, CairnRun, can_run_criu, metric_steps, wait_for
from tests.support.resume_runs import REPO



@pytest.fixture(autouse=True)
def _committed_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The transform's CAIRN_COMMITTED_DIR, for the sidecar and the main container alike.
    monkeypatch.setenv("CAIRN_COMMITTED_DIR", str(tmp_path / "shared" / "committed"))


def _sidecar(tmp_path: Path, api: FakeKubernetesAPI, token: Path) -> tuple[SidecarProcess, Path]:
    shared = tmp_path / "shared"
    shared.mkdir()
    sidecar = SidecarProcess(shared, tmp_path / "logs", "--no-metadata", "--owner-job",
                             "/".join(JOB), "--kube-api", api.url, "--kube-token-file",
                             str(token))
    wait_for(lambda: (shared / channel.CAUSE_NAME).exists(), 30, "the sidecar's announcement")
    # The kubelet starts the main container once the sidecar's startup probe passes.
    wait_for(lambda: sidecar.get(STARTED_PATH)[0] == 200, 30, "the sidecar's startup probe")
    return sidecar, shared


def _job_gets(api: FakeKubernetesAPI) -> int:
    return sum(1 for r in api.requests if r.path == "/apis/batch/v1/namespaces/ml/jobs/train"
               and r.method == "GET")


@pytest.mark.parametrize("case", ["suspended", "running", "forbidden"])
def test_the_sidecar_answers_an_ask_with_the_jobs_suspend(
        tmp_path: Path, fake_api: tuple[FakeKubernetesAPI, Path], case: str) -> None:
    """The protocol alone (no CRIU): the ask is what ``cairn run`` writes on SIGTERM."""
    api, token = fake_api
    api.jobs[JOB] = case == "suspended"
    if case == "forbidden":
        api.forbidden.add("jobs")
    sidecar, shared = _sidecar(tmp_path, api, token)
    try:
        announced = channel.read_cause(str(shared))
        assert announced is not None and announced.asked_at is None
        # Read once before the main container starts (its committed seqs), not while it runs.
        assert _job_gets(api) == 1
        asked = channel.ask_cause(str(shared), signal_name="SIGTERM")
        assert asked is not None
        cause = channel.await_cause(str(shared), asked, timeout_s=30)
        assert cause is not None and cause.suspended is (case == "suspended")
        assert _job_gets(api) == 2
        if case == "forbidden":
            assert "the API server answered 403" in cause.reason
            assert "get on jobs (cairn.k8s.job_reader_rbac" in cause.reason
        elif case == "running":
            assert "Job ml/train is not suspended" in cause.reason
        else:
            assert "Job ml/train has spec.suspend: true" in cause.reason
        wait_for(lambda: cause.reason in sidecar.stderr, 30, "the reason in the sidecar's log")
    finally:
        assert sidecar.stop() == 0, sidecar.stderr


def test_without_a_responding_sidecar_nothing_is_asked(tmp_path: Path) -> None:
    assert channel.ask_cause(str(tmp_path), signal_name="SIGTERM") is None
    assert not (tmp_path / channel.TERMINATING_NAME).exists()


def _run(tmp_path: Path, shared: Path, key: str, metrics_file: Path, every: str) -> CairnRun:
    return CairnRun(store=str(tmp_path / "store"), key=key, workdir=shared / "run",
                    command=[sys.executable, str(COUNTER), str(metrics_file), "120", "0.05"],
                    logs=tmp_path / "logs", every=every, grace="30s",
                    extra=["--notice-file", str(shared / channel.NOTICE_NAME),
                           "--status-file", str(shared / channel.STATUS_NAME)])


def _outcome(tmp_path: Path, key: str) -> object:
    with open_store(str(tmp_path / "store"), create=False) as store:
        return store.records.outcomes(Key.parse(key))[-1]


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@pytest.mark.slow
@pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)")
def test_a_kueue_eviction_ends_suspended_and_the_readmitted_pod_resumes(
        tmp_path: Path, fake_api: tuple[FakeKubernetesAPI, Path]) -> None:
    api, token = fake_api
    sidecar, shared = _sidecar(tmp_path, api, token)
    key, metrics_file = "ml/train/0", tmp_path / "metrics.txt"
    try:
        first = _run(tmp_path, shared, key, metrics_file, every="0")
        wait_for(lambda: metrics_file.exists() and len(metric_steps(metrics_file)) >= 10 or first.proc.poll() is not None,
                 60, "the workload to step")
        api.jobs[JOB] = True  # Kueue evicts: spec.suspend, then the Job controller deletes pods
        first.signal(signal.SIGTERM)  # the kubelet's SIGTERM to the main container
        assert first.wait(120) == 77, first.stderr
        final = first.committed()[-1]
        assert "Job ml/train has spec.suspend: true" in first.stderr
        outcome = _outcome(tmp_path, key)
        assert outcome.outcome.value == "suspended"
        assert outcome.detail["cause"]["suspended"] is True
        assert outcome.progress.snapshot_seq == final
        done = len(metric_steps(metrics_file))
        assert 0 < done < 120

        # Kueue readmits the Job: a new pod, same key, resumes from the final snapshot (an
        # eviction is not a suspend request, so nothing holds the key).
        api.jobs[JOB] = False
        second = _run(tmp_path, shared, key, metrics_file, every="0")
        assert second.wait(120) == 0, second.stderr
        assert f"restored snapshot seq {final}" in second.stderr
        assert metric_steps(metrics_file) == list(range(120))  # no step lost or redone
    finally:
        assert sidecar.stop() == 0, sidecar.stderr


@pytest.mark.isolated  # CRIU restores at fixed PIDs
@pytest.mark.slow
@pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)")
@pytest.mark.parametrize("case", ["drain", "forbidden"])
def test_a_drain_or_an_unreadable_job_ends_preempted_with_the_reason(
        tmp_path: Path, fake_api: tuple[FakeKubernetesAPI, Path], case: str) -> None:
    api, token = fake_api
    if case == "forbidden":
        api.jobs[JOB] = True  # suspended, but the sidecar may not read it: taken as preempted
        api.forbidden.add("jobs")
    sidecar, shared = _sidecar(tmp_path, api, token)
    key, metrics_file = "ml/train/1", tmp_path / "metrics.txt"
    try:
        run = _run(tmp_path, shared, key, metrics_file, every="0")
        wait_for(lambda: metrics_file.exists() and len(metric_steps(metrics_file)) >= 5 or run.proc.poll() is not None,
                 60, "the workload to step")
        run.signal(signal.SIGTERM)
        assert run.wait(120) == 75, run.stderr
        outcome = _outcome(tmp_path, key)
        assert outcome.outcome.value == "preempted"
        assert outcome.progress.snapshot_seq == run.committed()[-1]
        reason = outcome.detail["cause"]["reason"]
        assert outcome.detail["cause"]["suspended"] is False
        if case == "forbidden":
            assert "answered 403" in reason and "get on jobs" in reason
        else:
            assert "Job ml/train is not suspended" in reason
        assert reason in run.stderr and reason in sidecar.stderr
    finally:
        assert sidecar.stop() == 0, sidecar.stderr


# -- state mode: the Checkpointer asks the sidecar as cairn run does --------------------------

class _StateRun:
    """``tests/support/tiny_training.py`` (a real torch training step loop with the
    Checkpointer) as the transformed state-mode pod's main container runs it: its
    ``CAIRN_NOTICE_FILE`` in the volume it shares with the sidecar."""

    def __init__(self, tmp_path: Path, shared: Path, key: str, name: str) -> None:
        self.out = tmp_path / f"{name}.out"
        self.err = tmp_path / f"{name}.err"
        env = {**os.environ, "CAIRN_NOTICE_FILE": str(shared / channel.NOTICE_NAME)}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.tiny_training", str(tmp_path / "store"),
                 key, str(tmp_path / f"{name}.pt"), "--total", str(STATE_STEPS),
                 "--every", "1000", "--pace", "0.02"],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    def wait_for_steps(self, steps: int) -> None:
        wait_for(lambda: len(self.lines("loss")) >= steps or self.proc.poll() is not None, 120,
                 f"{steps} training steps")
        assert self.proc.poll() is None, self.stderr

    def lines(self, word: str) -> list[int]:
        return [int(line.split()[1]) for line in self.out.read_text().splitlines()
                if line.startswith(word + " ")]

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


STATE_STEPS = 400


def _state_snapshots(tmp_path: Path, key: str) -> list:  # noqa: ANN001
    with open_store(str(tmp_path / "store"), create=False) as store:
        return store.snapshots(Key.parse(key))


@pytest.mark.slow
def test_a_kueue_eviction_of_a_state_mode_pod_ends_suspended_and_resumes(
        tmp_path: Path, fake_api: tuple[FakeKubernetesAPI, Path]) -> None:
    api, token = fake_api
    sidecar, shared = _sidecar(tmp_path, api, token)
    key = "ml/train/2"
    try:
        first = _StateRun(tmp_path, shared, key, "first")
        first.wait_for_steps(20)
        api.jobs[JOB] = True  # Kueue evicts: spec.suspend, then the pods get SIGTERM
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait(120) == 77, first.stderr
        assert "Job ml/train has spec.suspend: true" in first.stderr
        assert "suspended, not preempted" in first.stderr
        assert _job_gets(api) == 2  # the committed seqs at the start, the ask
        (final,) = _state_snapshots(tmp_path, key)  # every=1000: only the final snapshot
        # The Checkpointer recorded it; the sidecar keeps it in the Job for the next pod.
        with open_store(str(tmp_path / "store"), create=False) as store:
            store_url = store.url
        wait_for(lambda: parse_entries(api.annotations.get(JOB, {}).get(ANNOTATION), where="")
                 == {(store_url, key): final.seq}, 30, "the final seq in the Job's annotation")
        outcome = _outcome(tmp_path, key)
        assert outcome.outcome.value == "suspended"
        assert outcome.detail["cause"]["suspended"] is True
        assert outcome.progress.snapshot_seq == final.seq
        assert final.manifest.step == first.lines("loss")[-1]

        api.jobs[JOB] = False  # readmitted: a new pod, the same key, resumes at once
        second = _StateRun(tmp_path, shared, key, "second")
        assert second.wait(180) == 0, second.stderr
        assert second.lines("start") == [final.manifest.step + 1]
        assert second.lines("loss") == list(range(final.manifest.step + 1, STATE_STEPS))
    finally:
        assert sidecar.stop() == 0, sidecar.stderr


@pytest.mark.slow
def test_a_drain_of_a_state_mode_pod_stays_a_preemption(
        tmp_path: Path, fake_api: tuple[FakeKubernetesAPI, Path]) -> None:
    """Not suspended: the final snapshot, the reason logged, and the signal handed on as
    before; the script installed no handler of its own, so it exits 75 (PreemptedExit), as
    ``cairn run`` does; no suspended outcome."""
    api, token = fake_api
    sidecar, shared = _sidecar(tmp_path, api, token)
    key = "ml/train/3"
    try:
        run = _StateRun(tmp_path, shared, key, "run")
        run.wait_for_steps(20)
        run.proc.send_signal(signal.SIGTERM)
        assert run.wait(120) == 75, run.stderr
        assert "Job ml/train is not suspended" in run.stderr
        assert _job_gets(api) == 2
        (final,) = _state_snapshots(tmp_path, key)
        assert final.manifest.step == run.lines("loss")[-1]
        with open_store(str(tmp_path / "store"), create=False) as store:
            assert [o.outcome.value for o in store.records.outcomes(Key.parse(key))] == []
    finally:
        assert sidecar.stop() == 0, sidecar.stderr
