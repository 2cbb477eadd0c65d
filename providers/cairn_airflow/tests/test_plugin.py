"""The cairn Airflow plugin without a server: registration, the extra link, the report and the
page built from a real local store (snapshots written with the store API)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

KEY = ("train_dag", "train", "manual__2026-11-29T22:00:00+00:00", "-1")


def _commit(attempt, step: int, payload: bytes) -> int:  # noqa: ANN001 - a cairn Attempt
    with attempt.snapshot() as snap:
        snap.add_bytes("frozen.bin", b"F" * 200_000)  # unchanged: deduplicated after the first
        snap.add_bytes("weights.bin", payload)
        return snap.commit(step=step).seq


@pytest.fixture()
def store(tmp_path: Path) -> Iterator:
    """Two attempts: the first commits steps 4, 9, 14 and dies; the second resumes after 14
    and commits 19, 24 (retention keeps the newest three)."""
    from cairn.store import Key
    from cairn import open_store

    with open_store(str(tmp_path / "store")) as store:
        key = Key(KEY)
        first = store.open_attempt(key, note={"mode": "state"})
        for step in (4, 9, 14):
            _commit(first, step, bytes([step]) * 50_000)
            time.sleep(0.01)  # distinct timestamps for the measured seconds per step
        second = store.open_attempt(key, note={"mode": "state"})
        for step in (19, 24):
            _commit(second, step, bytes([step]) * 50_000)
            time.sleep(0.01)
        yield store


def test_the_entry_point_loads_the_plugin_and_the_provider_lists_the_link() -> None:
    import cairn_airflow
    from cairn_airflow.plugins.plugin import CairnPlugin

    [ep] = [e for e in entry_points(group="airflow.plugins") if e.name == "cairn"]
    assert ep.load() is CairnPlugin
    links = cairn_airflow.get_provider_info()["extra-links"]
    assert links == ["cairn_airflow.plugins.links.CairnSnapshotsLink"]
    plugin = CairnPlugin()
    [view] = plugin.external_views
    assert view["destination"] == "task_instance"
    assert view["href"].startswith("/cairn/snapshots?") and "{RUN_ID}" in view["href"]
    assert [type(link).__name__ for link in plugin.operator_extra_links] == ["CairnSnapshotsLink"]


def test_the_link_is_attached_to_serialized_cairn_tasks_and_names_the_task_instance() -> None:
    """What the api-server does: deserialize the DAG; the plugin's link joins cairn operators
    (both ``CairnPythonOperator`` and ``@task.cairn``) and not others."""
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import DAG, task
    from airflow.serialization.serialized_objects import DagSerialization

    from cairn_airflow import CairnPythonOperator

    with DAG("link_dag", schedule=None) as dag:
        @task.cairn(every_steps=5)
        def decorated(ckpt):
            return None

        @task
        def plain():
            return None

        decorated()
        plain()
        CairnPythonOperator(task_id="classic", python_callable=lambda ckpt: None)

    restored = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert restored.get_task("plain").extra_links == []
    for task_id in ("decorated", "classic"):
        op = restored.get_task(task_id)
        assert op.extra_links == ["cairn snapshots"]
        ti_key = TaskInstanceKey("link_dag", task_id, "manual__2026-11-29T22:00:00+00:00", 1, 3)
        url = op.operator_extra_link_dict["cairn snapshots"].get_link(op, ti_key=ti_key)
        parts = urlsplit(url)
        assert parts.path == "/cairn/snapshots"
        assert parse_qs(parts.query) == {"dag_id": ["link_dag"], "task_id": [task_id],
                                         "run_id": ["manual__2026-11-29T22:00:00+00:00"],
                                         "map_index": ["3"]}


def test_map_index_from_the_ui_template() -> None:
    from fastapi import HTTPException

    from cairn_airflow.plugins.app import parse_map_index

    assert parse_map_index(None) == -1 and parse_map_index("{MAP_INDEX}") == -1
    assert parse_map_index("7") == 7
    with pytest.raises(HTTPException) as err:
        parse_map_index("seven")
    assert err.value.status_code == 422 and "integer" in str(err.value.detail)


def test_report_lists_snapshots_attempts_and_the_saved_work(store) -> None:  # noqa: ANN001
    from cairn.store import Key
    from cairn_airflow.plugins.report import build_report

    report = build_report(store, Key(KEY))
    assert report.state == "active"
    assert [s.step for s in report.snapshots] == [24, 19, 14]  # newest first, 4 and 9 pruned
    assert all(s.status == "present" for s in report.snapshots)
    oldest = report.snapshots[-1]
    assert oldest.bytes_logical == 250_000 and oldest.bytes_written < oldest.bytes_logical
    assert oldest.dedup_ratio == pytest.approx(250_000 / oldest.bytes_written)
    first, second = report.tries
    # It committed three; retention kept one, and the count comes from the log's seqs.
    assert (first.resumed_from, first.snapshots, first.last_step) == (None, 3, 14)
    assert first.ended == f"followed by epoch {second.epoch}"
    assert second.resumed_from == oldest.seq and second.resumed_step == 14
    assert second.steps_saved == 15 and second.ended == "no done record"
    assert report.steps_saved == 15 and report.seconds_per_step is not None
    assert second.seconds_saved == pytest.approx(15 * report.seconds_per_step)
    assert [r.step for r in report.resumes] == [14]
    assert [p.step for p in report.points] == [14, 19, 24]
    assert second.outcome is None and not report.outcomes_available


def test_deep_verify_finds_corruption_and_present_a_missing_pack(store) -> None:  # noqa: ANN001
    from cairn.store import Key
    from cairn_airflow.plugins.report import build_report

    key = Key(KEY)
    newest = store.snapshots(key)[0].manifest
    chunk = newest.file("weights.bin").chunks[0]
    pack_path = Path(store.url.removeprefix("file://")) / chunk.pack
    data = bytearray(pack_path.read_bytes())
    data[chunk.offset] ^= 0xFF
    pack_path.chmod(0o644)
    pack_path.write_bytes(bytes(data))

    deep = build_report(store, key, deep=True)
    assert deep.deep_verified
    bad = {s.seq: s for s in deep.snapshots}[newest.seq]
    assert bad.status == "corrupt" and "digest mismatch" in bad.reason
    assert [s.status for s in deep.snapshots if s.seq != newest.seq] == ["verified", "verified"]

    pack_path.unlink()
    cheap = build_report(store, key)
    assert {s.seq: s.status for s in cheap.snapshots}[newest.seq] == "missing"


def test_a_finished_key_shows_done_and_a_fresh_key_shows_nothing(store) -> None:  # noqa: ANN001
    from cairn.store import Key
    from cairn_airflow.plugins.report import build_report

    key = Key(KEY)
    attempt = store.open_attempt(key, note={"mode": "state"})
    attempt.finish()
    report = build_report(store, key)
    assert report.state == "done" and report.snapshots == ()
    assert report.tries[-1].ended == "succeeded"
    assert any("snapshots were removed" in n for n in report.notes)
    assert build_report(store, Key(("other", "t", "r", "-1"))).state == "no records"


def test_page_escapes_values_and_draws_the_resume(store) -> None:  # noqa: ANN001
    from cairn.store import Key
    from cairn_airflow.plugins.page import render_page
    from cairn_airflow.plugins.report import build_report

    report = build_report(store, Key(KEY))
    ti = {"dag_id": "<script>alert(1)</script>", "task_id": "train", "run_id": KEY[2],
          "map_index": "-1"}
    html = render_page(report, ti=ti, api_url="/cairn/api/snapshots?x=1",
                       verify_url="/cairn/snapshots?x=1&verify=deep")
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert html.count('class="snapshot-row"') == 3 and html.count('class="try-row"') == 2
    assert "15 steps not redone" in html and 'id="progress-chart"' in html
    assert "not recorded" in html  # the outcome column waits for outcome records


def test_outcome_records_fill_the_outcome_column_and_a_pruned_resume_step(tmp_path: Path) -> None:
    """Retention removed the snapshot a try resumed from; its outcome record still tells the
    step it started at, and how it ended."""
    from cairn.store import Key, StoreSettings
    from cairn import open_store
    from cairn.store.outcomes import Outcome, OutcomeKind, Progress
    from cairn_airflow.plugins.app import _outcomes
    from cairn_airflow.plugins.page import render_page
    from cairn_airflow.plugins.report import build_report

    key = Key(KEY)
    with open_store(str(tmp_path / "store"), settings=StoreSettings(keep_last=1)) as store:
        first = store.open_attempt(key, note={"mode": "state"})
        _commit(first, 9, b"a" * 1000)
        now = time.time()
        store.records.record_outcome(key, Outcome(epoch=first.epoch, outcome=OutcomeKind.PREEMPTED,
                                          started_at=now - 60, ended_at=now,
                                          progress=Progress(start_step=0, end_step=12,
                                                            kept_step=9),
                                          reason="spot reclaimed"))
        second = store.open_attempt(key, note={"mode": "state"})
        _commit(second, 19, b"b" * 1000)  # keep_last=1 prunes step 9
        store.records.record_outcome(key, Outcome(epoch=second.epoch, outcome=OutcomeKind.SUCCEEDED,
                                          started_at=now, ended_at=now + 30,
                                          progress=Progress(start_step=9, end_step=19)))
        outcomes = _outcomes(store, key)
        report = build_report(store, key, outcomes=outcomes)
    assert [s.step for s in report.snapshots] == [19]
    one, two = report.tries
    assert one.outcome == "preempted at step 12 (spot reclaimed)"
    assert two.outcome == "succeeded at step 19"
    assert two.resumed_step == 9 and two.steps_saved == 10
    html = render_page(report, ti={"dag_id": "d", "task_id": "t", "run_id": "r",
                                   "map_index": "-1"}, api_url="/a", verify_url="/v")
    assert "preempted at step 12 (spot reclaimed)" in html and "not recorded" not in html


def test_loading_the_plugin_and_building_its_app_imports_no_torch_or_criu() -> None:
    """Every Airflow process loads plugins; the api-server image has no torch."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from cairn_airflow.plugins.plugin import CairnPlugin\n"
            "plugin = CairnPlugin()\n"
            "plugin.external_views, plugin.operator_extra_links, plugin.fastapi_apps\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'\n"
            "               or m.startswith('cairn.process') or m.startswith('cairn.state'))\n"
            "print(heavy)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_page_opens_an_encrypted_store_with_its_connections_secret(tmp_path: Path) -> None:
    from cairn.runtime.env import SECRET_FILE
    from cairn.store import SecretError, load_secret_file, write_secret_file
    from cairn import open_store
    from cairn_airflow.hooks import StoreConfig
    from cairn_airflow.plugins.app import open_config_store

    path = str(tmp_path / "store.secret")
    write_secret_file(path)
    url = str(tmp_path / "store")
    open_store(url, secret=load_secret_file(path)).close()
    with pytest.raises(SecretError):
        open_config_store(StoreConfig(url=url))
    with open_config_store(StoreConfig(url=url, env={SECRET_FILE.name: path})) as store:
        assert store.keys() == []
