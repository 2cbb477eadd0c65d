"""The sidecar's watchers against a FAKE GCE metadata server and a FAKE Kubernetes API server
(neither can run here), each a real HTTP server on 127.0.0.1 started by the test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cairn.exceptions import ConfigError
from cairn.runtime.channel import Notice
from cairn.k8s.watchers import (
    MAINTENANCE_LABEL,
    MetadataSettings,
    MetadataWatcher,
    NodeLabelWatcher,
    NodeSettings,
    parse_maintenance_time,
)
from tests.integration.k8s.fakes import FakeKubernetesAPI, FakeMetadataServer, serve
from tests.support.cairn_run import wait_for


@pytest.fixture()
def fake_metadata() -> Iterator[FakeMetadataServer]:
    fake = FakeMetadataServer()
    with serve(fake):
        yield fake


def _watch(fake: FakeMetadataServer, key: str) -> tuple[MetadataWatcher, list[Notice]]:
    notices: list[Notice] = []
    watcher = MetadataWatcher(MetadataSettings(base_url=fake.url, poll_timeout_s=20), key,
                              notices.append)
    watcher.start()
    return watcher, notices


def test_preempted_true_becomes_a_notice_with_the_preemption_window(
        fake_metadata: FakeMetadataServer) -> None:
    watcher, notices = _watch(fake_metadata, "preempted")
    try:
        # The watcher read FALSE and now long-polls with that value's ETag: no notice for it.
        wait_for(lambda: fake_metadata.waiting("preempted") >= 1, 20, "a long-poll on FALSE")
        assert notices == [] and watcher.healthy
        fake_metadata.set("preempted", "TRUE")
        wait_for(lambda: notices, 20, "a notice")
    finally:
        watcher.stop()
    (notice,) = notices
    assert notice.source == "gce-preempted" and "TRUE" in notice.reason
    assert notice.deadline - notice.issued_at == pytest.approx(15.0)
    first = fake_metadata.requests[0]
    assert first.headers["metadata-flavor"] == "Google"
    assert first.query["wait_for_change"] == "true" and "last_etag" not in first.query


def test_maintenance_terminate_is_a_notice_and_migrate_is_not(
        fake_metadata: FakeMetadataServer) -> None:
    watcher, notices = _watch(fake_metadata, "maintenance-event")
    try:
        wait_for(lambda: fake_metadata.waiting("maintenance-event") >= 1, 20, "a long-poll")
        fake_metadata.set("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
        wait_for(lambda: fake_metadata.waiting("maintenance-event") >= 1, 20, "MIGRATE read")
        assert notices == []
        fake_metadata.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        wait_for(lambda: notices, 20, "a notice")
    finally:
        watcher.stop()
    (notice,) = notices
    assert notice.source == "gce-maintenance"
    assert notice.deadline - notice.issued_at == pytest.approx(60.0)


def test_a_server_that_is_not_a_metadata_server_is_not_believed() -> None:
    fake = FakeMetadataServer(values={"preempted": "TRUE", "maintenance-event": "NONE"},
                              flavor_header=False)
    with serve(fake):
        watcher, notices = _watch(fake, "preempted")
        try:
            wait_for(lambda: len(fake.requests) >= 2, 20, "a retry")
        finally:
            watcher.stop()
    assert notices == [] and not watcher.healthy


def test_metadata_url_must_be_http() -> None:
    with pytest.raises(ConfigError, match="must start with http"):
        MetadataSettings(base_url="metadata.google.internal")


@pytest.fixture()
def fake_api(tmp_path: Path) -> Iterator[tuple[FakeKubernetesAPI, Path]]:
    fake = FakeKubernetesAPI()
    fake.nodes["node-a"] = {"cloud.google.com/gke-nodepool": "gpu"}
    token = tmp_path / "token"
    token.write_text(fake.token + "\n")
    with serve(fake):
        yield fake, token


def _node_watcher(fake: FakeKubernetesAPI, token: Path, **kw: float) -> tuple[NodeLabelWatcher,
                                                                           list[Notice]]:
    notices: list[Notice] = []
    settings = NodeSettings(node_name="node-a", api_url=fake.url, token_file=str(token),
                            ca_file=None, **kw)
    return NodeLabelWatcher(settings, notices.append), notices


def test_the_maintenance_label_notifies_within_the_lead_once(
        fake_api: tuple[FakeKubernetesAPI, Path]) -> None:
    fake, token = fake_api
    watcher, _ = _node_watcher(fake, token, lead_s=600)
    assert watcher.check_once() is None  # no label
    far = int(time.time()) + 7 * 86400
    fake.label("node-a", MAINTENANCE_LABEL, str(far))
    assert watcher.check_once() is None  # a week ahead: not yet
    soon = int(time.time()) + 300
    fake.label("node-a", MAINTENANCE_LABEL, str(soon))
    notice = watcher.check_once()
    assert notice is not None and notice.source == "node-label"
    assert notice.deadline == soon and MAINTENANCE_LABEL in notice.reason
    assert watcher.check_once() is None  # announced once
    assert fake.requests[-1].headers["authorization"] == f"Bearer {fake.token}"
    assert fake.requests[-1].path == "/api/v1/nodes/node-a"


def test_the_label_watcher_thread_delivers(fake_api: tuple[FakeKubernetesAPI, Path]) -> None:
    fake, token = fake_api
    watcher, notices = _node_watcher(fake, token, lead_s=600, interval_s=0.2)
    watcher.start()
    try:
        wait_for(lambda: len(fake.requests) >= 2, 20, "two polls")
        assert notices == []
        fake.label("node-a", MAINTENANCE_LABEL, str(int(time.time()) + 60))
        wait_for(lambda: notices, 20, "a notice")
    finally:
        watcher.stop()
    assert len(notices) == 1 and watcher.healthy


def test_a_forbidden_answer_names_the_rbac(fake_api: tuple[FakeKubernetesAPI, Path]) -> None:
    fake, token = fake_api
    token.write_text("another-token")
    watcher, _ = _node_watcher(fake, token)
    with pytest.raises(ConfigError, match="ClusterRole with get on nodes"):
        watcher.check_once()


def test_node_settings_need_a_node_name() -> None:
    with pytest.raises(ConfigError, match="NODE_NAME"):
        NodeSettings(node_name="", api_url="https://10.0.0.1:443")


@pytest.mark.parametrize("value,expected", [("1767225600", 1767225600.0),
                                            ("2026-01-01T00:00:00Z", 1767225600.0)])
def test_maintenance_time_formats(value: str, expected: float) -> None:
    assert parse_maintenance_time(value) == expected


def test_a_bad_maintenance_time_is_named() -> None:
    with pytest.raises(ConfigError, match="neither a Unix time nor RFC 3339"):
        parse_maintenance_time("next tuesday")
