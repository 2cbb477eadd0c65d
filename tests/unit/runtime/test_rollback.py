"""The committed-seq mark and the rollback checks of cairn.runtime.rollback (ADR 0049)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from cairn.exceptions import RollbackRefused
from cairn.runtime.rollback import (
    MARK_FILE_MODE,
    MarkMirror,
    local_mark,
    oldest_allowed,
    refuse_older,
    rollback_allowed,
)
from cairn.store import Key


def test_a_mark_only_moves_forward_and_only_its_user_reads_it(tmp_path: Path) -> None:
    mark = local_mark("s3://bucket/p", "dag/t/r/0", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    assert mark.read() is None
    mark.record(7)
    mark.record(5)  # an older commit reported late
    assert mark.read() == 7
    assert stat.S_IMODE(os.stat(mark.path).st_mode) == MARK_FILE_MODE
    assert os.path.dirname(mark.path) == str(tmp_path)


def test_marks_are_per_store_and_key(tmp_path: Path) -> None:
    environ = {"CAIRN_COMMITTED_DIR": str(tmp_path)}
    local_mark("gs://b/p", "a/b", environ).record(3)
    assert local_mark("gs://b/p", "a/c", environ).read() is None
    assert local_mark("gs://b/q", "a/b", environ).read() is None


def test_a_mark_that_is_not_this_keys_or_unreadable_is_ignored_saying_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mark = local_mark("gs://b/p", "a/b", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    Path(mark.path).write_text('{"store": "gs://b/other", "key": "a/b", "seq": 9}')
    assert mark.read() is None and "not this store's and key's" in caplog.text
    Path(mark.path).write_text("{")
    assert mark.read() is None and "unreadable committed-seq record" in caplog.text


def test_the_oldest_allowed_seq(tmp_path: Path) -> None:
    mark = local_mark("gs://b/p", "a/b", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    assert oldest_allowed(mark, allowed=False) is None  # nothing recorded
    mark.record(9)
    assert oldest_allowed(mark, allowed=False) == 9
    assert oldest_allowed(mark, allowed=True) is None
    assert oldest_allowed(mark, allowed=False, exclude={9}) is None  # the policy chose older
    assert oldest_allowed(mark, allowed=False, exclude={4}) == 9


def test_going_past_the_newer_snapshots_is_refused_naming_the_way_out(tmp_path: Path) -> None:
    mark = local_mark("gs://b/p", "a/b", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    key = Key.parse("a/b")
    refuse_older(key, 9, 9, mark)
    refuse_older(key, 3, None, mark)
    with pytest.raises(RollbackRefused, match="the next is seq 3.*--allow-rollback or "
                                              "CAIRN_ALLOW_ROLLBACK=1") as e:
        refuse_older(key, 3, 9, mark, flag="--allow-rollback")
    assert (e.value.recorded, e.value.found) == (9, 3) and mark.path in str(e.value)
    with pytest.raises(RollbackRefused, match="nothing older verifies"):
        refuse_older(key, None, 9, mark)


def test_the_allow_variable() -> None:
    assert rollback_allowed({"CAIRN_ALLOW_ROLLBACK": "1"})
    assert not rollback_allowed({"CAIRN_ALLOW_ROLLBACK": "0"}) and not rollback_allowed({})


def test_a_seq_kept_elsewhere_is_copied_in_and_named_in_refusals(tmp_path: Path) -> None:
    mark = local_mark("gs://b/p", "a/b", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    kept = mark.entry(9)
    assert mark.record(mark.seq_in(kept), source="Airflow's task state store") is True
    assert mark.read() == 9
    assert mark.where() == f"the file {mark.path}, copied from Airflow's task state store"
    assert mark.record(9) is False  # not newer
    assert mark.record(10) is True  # this node's own commit: no longer a copy
    assert mark.where() == f"the file {mark.path}"


@pytest.mark.parametrize("value", [
    {"store": "gs://b/other", "key": "a/b", "seq": 3},
    {"store": "gs://b/p", "key": "a/c", "seq": 3},
    {"store": "gs://b/p", "key": "a/b", "seq": "3"},
    {"store": "gs://b/p", "key": "a/b", "seq": True},
    [3], "3"])
def test_a_kept_value_of_another_store_or_key_or_malformed_gives_no_seq(
        value: object, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mark = local_mark("gs://b/p", "a/b", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    assert mark.seq_in(value) is None
    assert "not this store's and key's" in caplog.text
    assert mark.seq_in(None) is None


def test_the_mirror_publishes_each_newer_seq_and_retries_a_failed_publish(tmp_path: Path) -> None:
    mark = local_mark("s3://bucket/p", "k/1", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    published: list[dict] = []
    failures = [RuntimeError("API server unreachable")]
    seen = threading.Event()

    def publish(entry: dict) -> None:
        if failures:
            raise failures.pop()
        published.append(entry)
        seen.set()

    mirror = MarkMirror(mark, publish, published=2, poll_s=0.01)
    mark.record(2)  # already published by an earlier try: not again
    mirror.start()
    mark.record(4)
    assert seen.wait(5)
    mark.record(6)
    mirror.stop(timeout_s=5)
    assert not mirror.is_alive()
    assert published[0] == {"store": "s3://bucket/p", "key": "k/1", "seq": 4}
    assert published[-1]["seq"] == 6 and mirror.published == 6
    assert [e["seq"] for e in published] == sorted({e["seq"] for e in published})


def test_a_mirror_stuck_in_publish_does_not_hold_the_stop(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    mark = local_mark("s3://bucket/p", "k/1", {"CAIRN_COMMITTED_DIR": str(tmp_path)})
    release = threading.Event()
    mirror = MarkMirror(mark, lambda entry: release.wait(10), poll_s=0.01)
    mark.record(1)
    mirror.start()
    try:
        mirror.stop(timeout_s=0.2)
        assert mirror.is_alive()
        assert "did not finish within" in caplog.text
    finally:
        release.set()
        mirror.join(5)
