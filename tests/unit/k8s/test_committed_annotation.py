"""Rollback refused across a Job's pods (``cairn.k8s.committed``): the sidecar, in process,
against a FAKE Kubernetes API server (none can run here; ``tests/integration/k8s/fakes.py``,
with the real merge-patch and resourceVersion contract). It copies the Job's annotation
``cairn.dev/committed-seqs`` into the shared committed-seq directory before ``/startedz``
answers 200, keeps the annotation up with what is recorded there by real PATCHes, and a Job it
cannot read or patch, or a malformed annotation, never stops it."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cairn import open_store
from cairn.exceptions import RollbackRefused
from cairn.k8s.committed import (
    ANNOTATION,
    SHARED_DIR_MODE,
    SHARED_FILE_MODE,
    STARTED_PATH,
    SharedMarks,
    parse_entries,
    render,
)
from cairn.k8s.jobs import MERGE_PATCH, JobSettings, OwnerKind
from cairn.k8s.sidecar import Sidecar, SidecarSettings
from cairn.runtime import rollback
from cairn.store import Key
from tests.integration.k8s.fakes import FakeKubernetesAPI, serve
from tests.support.cairn_run import wait_for

JOB = ("ml", "train")
STORE = "gs://bucket/cairn"
SOURCE = "the annotation cairn.dev/committed-seqs of Job ml/train"
LOGGER = "cairn.sidecar.committed"


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[tuple[FakeKubernetesAPI, JobSettings]]:
    fake = FakeKubernetesAPI()
    fake.jobs[JOB] = False
    token = tmp_path / "token"
    token.write_text(fake.token + "\n")
    with serve(fake):
        yield fake, JobSettings(namespace="ml", name="train", api_url=fake.url,
                                token_file=str(token), timeout_s=10)


def _sidecar(tmp_path: Path, job: JobSettings, *, poll_s: float = 0.05) -> Sidecar:
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    sidecar = Sidecar(SidecarSettings(shared_dir=str(shared), port=0, host="127.0.0.1",
                                      metadata=None, job=job,
                                      committed_dir=str(shared / "committed")))
    assert sidecar.annotation is not None
    sidecar.annotation.poll_s = poll_s
    return sidecar


def _get(sidecar: Sidecar, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _started(sidecar: Sidecar) -> bool:
    return _get(sidecar, STARTED_PATH)[0] == 200


def _mark(sidecar: Sidecar, key: str, store: str = STORE) -> rollback.CommittedMark:
    """The mark the main container reads: its environment names the same directory."""
    assert sidecar.settings.committed_dir is not None
    return rollback.local_mark(store, key, {"CAIRN_COMMITTED_DIR": sidecar.settings.committed_dir})


def _kept(fake: FakeKubernetesAPI) -> dict[tuple[str, str], int]:
    return parse_entries(fake.annotations.get(JOB, {}).get(ANNOTATION), where="the fake Job")


def _job_gets(fake: FakeKubernetesAPI) -> int:
    return sum(1 for r in list(fake.requests) if r.method == "GET" and "/jobs/" in r.path)


def test_the_annotation_is_seeded_before_startedz_answers(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path) -> None:
    fake, job = api
    with open_store(str(tmp_path / "store")) as store:
        fake.annotations[JOB] = {ANNOTATION: render({(store.url, "ml/train/0"): 7,
                                                     (STORE, "ml/train/1"): 3})}
        fake.reads_open.clear()  # a slow API server: the read is held
        sidecar = _sidecar(tmp_path, job)
        sidecar.start()
        try:
            wait_for(lambda: _job_gets(fake) == 1, 10, "the sidecar to read its Job")
            assert _get(sidecar, STARTED_PATH) == (
                503, "reading the committed seqs from Job ml/train\n")
            assert _get(sidecar, "/readyz")[0] == 200  # ready, not started: nothing waits on it
            mark = _mark(sidecar, "ml/train/0", store.url)
            assert mark.read() is None
            fake.reads_open.set()
            wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
            # Recorded by the time it answers: the main container starts after this.
            assert mark.read() == 7 and _mark(sidecar, "ml/train/1").read() == 3
            assert SOURCE in mark.where()
            # The group-shared directory, so that the main container (another user in the
            # pod's fsGroup) writes its records there and reads these.
            assert stat.S_IMODE(os.stat(sidecar.settings.committed_dir).st_mode) == SHARED_DIR_MODE
            assert stat.S_IMODE(os.stat(mark.path).st_mode) == SHARED_FILE_MODE

            # The new pod's try refuses to begin older than the earlier pod committed (here:
            # the store has lost every snapshot of the key), naming the annotation.
            floor = rollback.oldest_allowed(mark, allowed=False)
            assert floor == 7
            with pytest.raises(RollbackRefused, match="copied from the annotation "
                               "cairn.dev/committed-seqs of Job ml/train"):
                rollback.open_attempt(store, Key.parse("ml/train/0"), mark, floor=floor)
        finally:
            sidecar.stop()
    assert fake.patches() == []  # nothing advanced past what the annotation held


def test_a_commit_recorded_in_the_directory_is_patched_into_the_annotation(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path) -> None:
    fake, job = api
    fake.annotations[JOB] = {ANNOTATION: render({(STORE, "ml/train/1"): 3}),
                             "team": "ml"}
    sidecar = _sidecar(tmp_path, job)
    sidecar.start()
    try:
        wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
        # The main container's try records a commit, as the Checkpointer or cairn run does.
        assert _mark(sidecar, "ml/train/0").record(12)
        wait_for(lambda: _kept(fake).get((STORE, "ml/train/0")) == 12, 10, "the PATCH")
        assert _kept(fake) == {(STORE, "ml/train/0"): 12, (STORE, "ml/train/1"): 3}
        assert fake.annotations[JOB]["team"] == "ml"  # a merge patch leaves the others
        (patch,) = fake.patches()
        assert patch.path == "/apis/batch/v1/namespaces/ml/jobs/train"
        assert patch.headers["content-type"] == MERGE_PATCH
        assert patch.headers["authorization"] == "Bearer fake-token"
        body = json.loads(patch.body)
        assert set(body) == {"metadata"} and set(body["metadata"]) == {"annotations",
                                                                      "resourceVersion"}
        assert body["metadata"]["resourceVersion"] == "1"  # the version it read

        time.sleep(0.5)  # ten polls, nothing advanced: no request
        assert len(fake.patches()) == 1 and _job_gets(fake) == 1

        # Another pod of the Job patched its own entry since: ours gets a 409, is read again
        # and merged, and neither pod's entry is lost.
        fake.annotations[JOB][ANNOTATION] = render({**_kept(fake), (STORE, "ml/train/2"): 5})
        fake.touch(*JOB)
        assert _mark(sidecar, "ml/train/0").record(13)
        wait_for(lambda: _kept(fake).get((STORE, "ml/train/0")) == 13, 10, "the second PATCH")
        assert _kept(fake) == {(STORE, "ml/train/0"): 13, (STORE, "ml/train/1"): 3,
                               (STORE, "ml/train/2"): 5}
        assert len(fake.patches()) == 3 and _job_gets(fake) == 2  # 409, read, patch
        assert _get(sidecar, "/readyz")[0] == 200
    finally:
        sidecar.stop()


def test_a_bare_pod_keeps_its_committed_seqs_in_its_own_annotation(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``--owner-pod``: the annotation its creator set on the pod is seeded before
    ``/startedz`` answers, and a commit is patched into the pod's own annotation, where the
    creator reads it back (the Airflow pod operator carries it to the next pod)."""
    fake = FakeKubernetesAPI()
    pod = ("ml", "train-x7k2p")
    fake.pods.add(pod)
    fake.pod_annotations[pod] = {ANNOTATION: render({(STORE, "ml/train/0"): 7})}
    token = tmp_path / "token"
    token.write_text(fake.token)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with serve(fake):
        own = JobSettings(namespace="ml", name="train-x7k2p", api_url=fake.url,
                          token_file=str(token), timeout_s=10, kind=OwnerKind.POD)
        shared = tmp_path / "shared"
        shared.mkdir()
        sidecar = Sidecar(SidecarSettings(shared_dir=str(shared), port=0, host="127.0.0.1",
                                          metadata=None, pod=own,
                                          committed_dir=str(shared / "committed")))
        assert sidecar.annotation is not None and sidecar.responder is None  # no Job to ask
        sidecar.annotation.poll_s = 0.05
        sidecar.start()
        try:
            wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
            mark = _mark(sidecar, "ml/train/0")
            assert mark.read() == 7
            assert "the annotation cairn.dev/committed-seqs of Pod ml/train-x7k2p" in mark.where()
            assert "earlier tries (as the creator of Pod ml/train-x7k2p recorded them) " \
                "committed ml/train/0 seq 7" in caplog.text
            assert mark.record(9)
            wait_for(lambda: parse_entries(fake.pod_annotations[pod].get(ANNOTATION), where="")
                     == {(STORE, "ml/train/0"): 9}, 10, "the PATCH of the pod")
        finally:
            sidecar.stop()
    (patch,) = fake.patches()
    assert patch.path == "/api/v1/namespaces/ml/pods/train-x7k2p"
    assert [r.path for r in fake.requests if r.method == "GET"] == [patch.path]
    assert fake.annotations == {}  # no Job was touched


def test_a_pod_without_the_grant_says_which_role_to_bind(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeKubernetesAPI()
    fake.pods.add(("ml", "p"))
    fake.forbidden.add("pods")
    token = tmp_path / "token"
    token.write_text(fake.token)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with serve(fake):
        own = JobSettings(namespace="ml", name="p", api_url=fake.url, token_file=str(token),
                          timeout_s=10, kind=OwnerKind.POD)
        shared = tmp_path / "shared"
        shared.mkdir()
        sidecar = Sidecar(SidecarSettings(shared_dir=str(shared), port=0, host="127.0.0.1",
                                          metadata=None, pod=own,
                                          committed_dir=str(shared / "committed")))
        sidecar.start()
        try:
            wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200 all the same")
        finally:
            sidecar.stop()
    assert "get and patch on pods (cairn.k8s.pod_annotator_rbac)" in caplog.text
    assert "the next pod its creator makes for a retry cannot tell" in caplog.text


def test_the_last_commit_is_published_when_the_sidecar_stops(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path) -> None:
    """Native sidecars stop after the main container: its final snapshot's seq, recorded in
    the second before, is patched on the way out."""
    fake, job = api
    sidecar = _sidecar(tmp_path, job, poll_s=3600)  # no poll would come in time
    sidecar.start()
    try:
        wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
        assert _mark(sidecar, "ml/train/0").record(40)
    finally:
        sidecar.stop()
    assert _kept(fake) == {(STORE, "ml/train/0"): 40}


def test_the_uploaders_commits_are_recorded_where_the_annotation_is_kept_from(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path) -> None:
    """Process mode: the sidecar records what it commits itself, before the supervisor
    hears of it (``Uploader(on_commit=)``; tests/unit/k8s/test_uploader.py has its order)."""
    fake, job = api
    sidecar = _sidecar(tmp_path, job)
    sidecar.start()
    try:
        wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
        assert sidecar.marks is not None
        sidecar.marks.record_commit(STORE, "ml/train/0", 8)
        wait_for(lambda: _kept(fake) == {(STORE, "ml/train/0"): 8}, 10, "the PATCH")
    finally:
        sidecar.stop()


@pytest.mark.parametrize("problem", ["forbidden", "unreachable"])
def test_a_job_it_cannot_read_leaves_the_sidecar_running(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path,
        caplog: pytest.LogCaptureFixture, problem: str) -> None:
    fake, job = api
    fake.annotations[JOB] = {ANNOTATION: render({(STORE, "ml/train/0"): 7})}
    if problem == "forbidden":
        fake.forbidden.add("jobs")  # no Role bound
    else:
        job = JobSettings(namespace="ml", name="train", api_url="http://127.0.0.1:9",
                          token_file=job.token_file, timeout_s=2)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sidecar = _sidecar(tmp_path, job)
    sidecar.start()
    try:
        wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200 anyway")
        assert _mark(sidecar, "ml/train/0").read() is None  # nothing to seed from
        said = caplog.text
        assert f"cannot read {SOURCE}" in said
        assert "only the file in this pod protects a restart of its main container" in said
        if problem == "forbidden":
            assert "answered 403: grant the pod's service account get and patch on jobs" in said
        # Commits go on being recorded; the patch fails, is logged once, and backs off.
        for seq in (1, 2, 3):
            assert _mark(sidecar, "ml/train/0").record(seq)
            time.sleep(0.2)
        assert caplog.text.count(f"cannot keep the committed seqs in {SOURCE}") == 1
        assert _get(sidecar, "/readyz")[0] == 200 and sidecar.annotation.is_alive()
    finally:
        sidecar.stop()
    assert ANNOTATION in fake.annotations[JOB] and _kept(fake) == {(STORE, "ml/train/0"): 7}


def test_without_patch_the_sidecar_says_the_next_pod_is_not_protected(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A Role with get only (job_reader_rbac before the annotation): seeded, never kept."""
    fake, job = api
    fake.annotations[JOB] = {ANNOTATION: render({(STORE, "ml/train/0"): 7})}
    fake.forbidden.add("jobs/patch")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sidecar = _sidecar(tmp_path, job)
    sidecar.start()
    try:
        wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
        assert _mark(sidecar, "ml/train/0").read() == 7
        assert _mark(sidecar, "ml/train/0").record(9)
        wait_for(lambda: fake.patches(), 10, "a PATCH")
        time.sleep(0.5)  # a backoff, not a patch a poll
        assert len(fake.patches()) <= 4
        said = caplog.text
        assert said.count(f"cannot keep the committed seqs in {SOURCE} (the API server "
                          "answered 403: grant the pod's service account get and patch on "
                          "jobs (cairn.k8s.job_reader_rbac)): only the file in this pod "
                          "protects a restart of its main container; the Job's next pod "
                          "cannot tell") == 1
    finally:
        sidecar.stop()
    assert _kept(fake) == {(STORE, "ml/train/0"): 7}


MALFORMED: list[tuple[str, Any, dict[tuple[str, str], int]]] = [
    ("not JSON", "[{store", {}),
    ("not a list", json.dumps({"store": STORE, "key": "a/b", "seq": 1}), {}),
    ("a number", 7, {}),
    ("bad entries left out", json.dumps([
        {"store": STORE, "key": "a/b", "seq": 4}, {"store": STORE, "key": "a/b"},
        {"store": STORE, "key": "a/c", "seq": True}, {"store": STORE, "key": "a/d", "seq": -1},
        {"store": "", "key": "a/e", "seq": 1}, "a/f", {"store": STORE, "key": "a/b", "seq": 2}]),
     {(STORE, "a/b"): 4}),
]


@pytest.mark.parametrize("value,expected", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_a_malformed_annotation_is_logged_and_ignored(
        value: Any, expected: dict[tuple[str, str], int],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert parse_entries(value, where=SOURCE) == expected
    assert f"ignoring {SOURCE}" in caplog.text or f"ignoring an entry of {SOURCE}" in caplog.text


def test_a_malformed_annotation_neither_stops_the_pod_nor_survives_the_next_commit(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake, job = api
    fake.annotations[JOB] = {ANNOTATION: "{not json"}
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sidecar = _sidecar(tmp_path, job)
    sidecar.start()
    try:
        wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
        assert f"ignoring {SOURCE}: not a JSON list of committed seqs" in caplog.text
        assert os.listdir(sidecar.settings.committed_dir) == []
        assert _mark(sidecar, "ml/train/0").record(2)
        wait_for(lambda: _kept(fake) == {(STORE, "ml/train/0"): 2}, 10, "a valid annotation")
    finally:
        sidecar.stop()


def test_the_directory_scan_skips_what_is_not_a_readable_mark(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    marks = SharedMarks(str(tmp_path / "committed"))
    assert marks.scan() == {}  # not there yet
    marks.prepare()
    assert marks.record(STORE, "a/b", 5) and not marks.record(STORE, "a/b", 4)
    directory = Path(marks.directory)
    (directory / "unreadable.json").mkdir()  # IsADirectoryError, as a 0600 file of another user
    (directory / "other.json").write_text(json.dumps({"store": STORE, "key": "a/c", "seq": 1}))
    (directory / ".tmp-123.json").write_text("{")  # a write in flight
    for _ in range(2):
        assert marks.scan() == {(STORE, "a/b"): 5}
    said = caplog.text
    assert said.count("cannot read the committed-seq record") == 1  # once per file
    assert said.count("other.json: not a committed-seq record") == 1
    assert ".tmp-123" not in said
    # A directory it did not make keeps its mode, and its files theirs.
    elsewhere = tmp_path / "private"
    elsewhere.mkdir(mode=0o700)
    private = SharedMarks(str(elsewhere))
    private.prepare()
    assert private.record(STORE, "a/b", 1)
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(rollback.local_mark(STORE, "a/b", private.environ).path)
                        .st_mode) == rollback.MARK_FILE_MODE


def test_render_is_stable_and_parses_back() -> None:
    entries = {(STORE, "b/c"): 2, (STORE, "a/b"): 10, ("file:///x", "a/b"): 1}
    text = render(entries)
    assert text == render(dict(reversed(list(entries.items()))))
    assert " " not in text and parse_entries(text, where="x") == entries


def test_an_entry_whose_store_is_no_store_url_is_skipped_and_the_rest_seeded(
        api: tuple[FakeKubernetesAPI, JobSettings], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake, job = api
    fake.annotations[JOB] = {ANNOTATION: json.dumps([
        {"store": "ftp://elsewhere/x", "key": "ml/train/0", "seq": 9},
        {"store": STORE, "key": "ml/train/1", "seq": 4}])}
    caplog.set_level(logging.WARNING, logger=LOGGER)
    sidecar = _sidecar(tmp_path, job)
    sidecar.start()
    try:
        wait_for(lambda: _started(sidecar), 10, "/startedz to answer 200")
        assert _mark(sidecar, "ml/train/1").read() == 4
        assert "unsupported store URL scheme 'ftp'" in caplog.text
        assert sidecar.annotation is not None and sidecar.annotation.is_alive()
        assert _mark(sidecar, "ml/train/1").record(5)  # the thread still publishes
        wait_for(lambda: _kept(fake).get((STORE, "ml/train/1")) == 5, 10, "the new seq kept")
    finally:
        sidecar.stop()
