"""The SLURM job's identity from its environment: the key, the try, the node; where ``cairn
run`` and ``Checkpointer.from_env()`` take it, and what outcome records carry."""

from __future__ import annotations

import time

import pytest

from cairn.exceptions import ConfigError
from cairn.runtime import endings, slurm
from cairn.store import Key
from cairn.store.outcomes import Outcome, OutcomeKind

JOB = {"SLURM_JOB_ID": "4242", "SLURM_CLUSTER_NAME": "hpc", "SLURMD_NODENAME": "gpu07",
       "SLURM_JOB_PARTITION": "spot"}


def test_outside_slurm_there_is_no_job_and_no_default_key() -> None:
    assert slurm.job_from_env({}) is None
    assert slurm.default_key({}) is None
    assert slurm.default_key({"CAIRN_KEY": "a/b"}) == "a/b"


def test_a_job_is_named_by_cluster_and_job_id_and_its_first_run_is_try_1() -> None:
    job = slurm.job_from_env(JOB)
    assert job is not None
    assert job.key_text() == "slurm/hpc/4242"
    assert Key.parse(job.key_text()).components == ("slurm", "hpc", "4242")
    assert (job.restart_count, job.try_number, job.node) == (0, 1, "gpu07")


def test_a_requeued_job_keeps_its_key_and_counts_its_tries() -> None:
    first = slurm.job_from_env(JOB)
    again = slurm.job_from_env({**JOB, "SLURM_RESTART_COUNT": "2", "SLURMD_NODENAME": "gpu09"})
    assert first is not None and again is not None
    assert again.key_text() == first.key_text()
    assert (again.restart_count, again.try_number, again.node) == (2, 3, "gpu09")


def test_an_array_task_is_named_by_the_array_job_and_its_task() -> None:
    # Each array task has a job id of its own; the array's id and the task index name the work.
    env = {**JOB, "SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"}
    job = slurm.job_from_env(env)
    assert job is not None and job.key_text() == "slurm/hpc/4242/7"
    assert job.detail()["array_task_id"] == "7" and job.detail()["job_id"] == "4250"


def test_without_a_cluster_name_the_key_still_names_the_job() -> None:
    job = slurm.job_from_env({"SLURM_JOB_ID": "9"})
    assert job is not None and job.key_text() == "slurm/cluster/9" and job.node is None


def test_cairn_key_wins_over_the_job() -> None:
    assert slurm.default_key({**JOB, "CAIRN_KEY": "my/own"}) == "my/own"
    assert slurm.default_key(JOB) == "slurm/hpc/4242"


@pytest.mark.parametrize("env, words", [
    ({**JOB, "SLURM_RESTART_COUNT": "x"}, "SLURM_RESTART_COUNT"),
    ({**JOB, "SLURM_ARRAY_JOB_ID": "4242"}, "SLURM_ARRAY_TASK_ID"),
])
def test_malformed_slurm_variables_are_named(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        slurm.job_from_env(env)


def test_outcome_records_name_the_job_the_try_and_the_node() -> None:
    now = time.time()
    outcome = Outcome(epoch=3, outcome=OutcomeKind.PREEMPTED, started_at=now, ended_at=now,
                      detail={"mode": "process"})
    tagged = endings.with_slurm_job(outcome, {**JOB, "SLURM_RESTART_COUNT": "1"})
    assert tagged.detail["mode"] == "process"
    assert tagged.detail["slurm"] == {"job_id": "4242", "restart_count": 1, "try": 2,
                                      "node": "gpu07", "cluster": "hpc", "partition": "spot"}
    assert endings.with_slurm_job(outcome, {}) is outcome
    # Malformed variables cost the record its SLURM detail, never the record.
    assert endings.with_slurm_job(outcome, {**JOB, "SLURM_RESTART_COUNT": "x"}) is outcome


def test_cairn_run_takes_the_jobs_key_and_shields_the_workload(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cairn.cli import main
    from cairn.process import supervisor

    seen = []
    monkeypatch.setattr(supervisor, "run", lambda settings: seen.append(settings) or 0)
    for name in ("CAIRN_KEY", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    assert main.main(["run", "--store", "/tmp/s", "--", "true"]) == 0
    assert seen[-1].key == "slurm/hpc/4242" and seen[-1].workload_ignores_sigterm
    assert main.main(["run", "--store", "/tmp/s", "--key", "k", "--", "true"]) == 0
    assert seen[-1].key == "k"


def test_cairn_run_outside_slurm_needs_a_key(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from cairn.cli import main
    from cairn.process import supervisor

    seen = []
    monkeypatch.setattr(supervisor, "run", lambda settings: seen.append(settings) or 0)
    for name in ("CAIRN_KEY", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert main.main(["run", "--store", "/tmp/s", "--", "true"]) == 2
    assert "give --store and --key" in capsys.readouterr().err
    assert main.main(["run", "--store", "/tmp/s", "--key", "k", "--", "true"]) == 0
    assert not seen[-1].workload_ignores_sigterm


def test_checkpointer_from_env_takes_the_jobs_key(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path) -> None:  # noqa: ANN001
    from cairn.state import Checkpointer

    monkeypatch.delenv("CAIRN_KEY", raising=False)
    monkeypatch.setenv("CAIRN_STORE", str(tmp_path / "store"))
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    ckpt = Checkpointer.from_env(preemption=None)
    try:
        assert str(ckpt.key) == "slurm/hpc/4242"
    finally:
        ckpt.close()
