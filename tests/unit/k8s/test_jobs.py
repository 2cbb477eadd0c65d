"""``cairn.k8s.jobs`` and the channel's ask/answer files in one process: the Job check against a
FAKE Kubernetes API server (none can run here), stale and malformed answers, bad settings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cairn.exceptions import ConfigError
from cairn.k8s.jobs import CauseResponder, JobSettings, check_job
from cairn.runtime import channel
from tests.integration.k8s.fakes import FakeKubernetesAPI, serve


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[tuple[FakeKubernetesAPI, JobSettings]]:
    fake = FakeKubernetesAPI()
    token = tmp_path / "token"
    token.write_text(fake.token + "\n")
    with serve(fake):
        yield fake, JobSettings(namespace="ml", name="train", api_url=fake.url,
                                token_file=str(token))


def test_check_job_reads_spec_suspend(api: tuple[FakeKubernetesAPI, JobSettings]) -> None:
    fake, settings = api
    fake.jobs[("ml", "train")] = True
    assert check_job(settings).suspended is True
    fake.jobs[("ml", "train")] = False
    cause = check_job(settings)
    assert cause.suspended is False and "is not suspended (spec.suspend: false)" in cause.reason
    assert fake.requests[-1].headers["authorization"] == "Bearer fake-token"


@pytest.mark.parametrize("problem,expected", [
    ("missing", "answered 404"), ("forbidden", "answered 403: grant the pod's service account "
                                               "get on jobs"),
    ("token", "answered 403"), ("down", "cannot read Job ml/train (")])
def test_what_cannot_be_read_is_not_a_suspension(api: tuple[FakeKubernetesAPI, JobSettings],
                                                 tmp_path: Path, problem: str,
                                                 expected: str) -> None:
    fake, settings = api
    fake.jobs[("ml", "train")] = True
    if problem == "missing":
        fake.jobs.clear()
    elif problem == "forbidden":
        fake.forbidden.add("jobs")
    elif problem == "token":
        (tmp_path / "token").write_text("another-token")
    else:
        settings = JobSettings(namespace="ml", name="train", api_url="http://127.0.0.1:9",
                               token_file=settings.token_file, timeout_s=2)
    cause = check_job(settings)
    assert cause.suspended is False and expected in cause.reason
    assert cause.reason.endswith("taken as a preemption")


def test_the_responder_answers_each_ask_once_and_stamps_it(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path) -> None:
    fake, settings = api
    fake.jobs[("ml", "train")] = True
    shared = tmp_path / "shared"
    shared.mkdir()
    responder = CauseResponder(settings, str(shared))
    assert responder.answer_once() is None  # not asked
    responder.announce()
    asked = channel.ask_cause(str(shared), signal_name="SIGTERM")
    assert asked is not None
    answer = responder.answer_once()
    assert answer is not None and answer.asked_at == asked and answer.suspended
    assert responder.answer_once() is None and len(fake.requests) == 1  # once per ask
    assert channel.await_cause(str(shared), asked, timeout_s=0) == answer
    # An answer to an earlier ask (a restarted supervisor) is not taken for this one.
    assert channel.await_cause(str(shared), asked + 1.0, timeout_s=0.1) is None


def test_malformed_channel_files_are_named(tmp_path: Path) -> None:
    (tmp_path / channel.CAUSE_NAME).write_text(json.dumps({"version": 1}))
    with pytest.raises(ConfigError, match="malformed cause"):
        channel.read_cause(str(tmp_path))
    assert channel.ask_cause(str(tmp_path), signal_name="SIGTERM") is None  # never raises
    (tmp_path / channel.TERMINATING_NAME).write_text(json.dumps({"version": 1}))
    with pytest.raises(ConfigError, match="malformed terminating.json"):
        channel.read_ask(str(tmp_path))


@pytest.mark.parametrize("owner", ["train", "ml/", "ml/a/b"])
def test_a_bad_owner_job_names_the_fix(owner: str) -> None:
    with pytest.raises(ConfigError, match="give NAMESPACE/JOB"):
        JobSettings.parse(owner, api_url="https://10.0.0.1")
