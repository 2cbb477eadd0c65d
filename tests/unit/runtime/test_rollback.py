"""The committed-seq mark and the rollback checks of cairn.runtime.rollback (ADR 0049)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cairn.exceptions import RollbackRefused
from cairn.runtime.rollback import (
    MARK_FILE_MODE,
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
