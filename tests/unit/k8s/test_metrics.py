"""The sidecar's /metrics page, parsed by prometheus_client's own text-format parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cairn.runtime.channel import RunStatus
from cairn.k8s.metrics import render


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_status_becomes_metrics() -> None:
    status = RunStatus(pid=10, started_at=1000.0, snapshots=3, failures=1, frozen_seconds=0.75,
                    stall_seconds=2.5, bytes_written=123456789, last_seq=9,
                    last_success_at=1500.5, last_error='criu: "dump" failed\nline 2',
                    last_error_at=1400.0, resumes=1, work_saved_seconds=321.5,
                    notices={"gce-preempted": 1}, updated_at=1600.0)
    text = render(status, notices_sent={"gce-preempted": 1, "sigterm": 2},
                  watchers_healthy={"metadata preempted": True}, now=1610.0)
    samples = _samples(text)
    assert samples[("cairn_snapshots_total", ())] == 3
    assert samples[("cairn_snapshot_failures_total", ())] == 1
    assert samples[("cairn_snapshot_frozen_seconds_total", ())] == 0.75
    assert samples[("cairn_snapshot_stall_seconds_total", ())] == 2.5
    assert samples[("cairn_snapshot_bytes_written_total", ())] == 123456789
    assert samples[("cairn_last_snapshot_success_timestamp_seconds", ())] == 1500.5
    assert samples[("cairn_last_snapshot_seq", ())] == 9
    assert samples[("cairn_resumes_total", ())] == 1
    assert samples[("cairn_work_saved_seconds_total", ())] == 321.5
    assert samples[("cairn_status_age_seconds", ())] == 10.0
    assert samples[("cairn_sidecar_notices_total", (("source", "sigterm"),))] == 2
    assert samples[("cairn_supervisor_notices_total", (("source", "gce-preempted"),))] == 1
    assert samples[("cairn_sidecar_watcher_healthy", (("watcher", "metadata preempted"),))] == 1
    # The error message survives the label escaping (quotes, newline) intact.
    assert samples[("cairn_last_error_info", (("error", 'criu: "dump" failed\nline 2'),))] == 1


def test_before_the_supervisor_reports() -> None:
    samples = _samples(render(None, notices_sent={}, watchers_healthy={}))
    assert samples == {("cairn_supervisor_reporting", ()): 0}
