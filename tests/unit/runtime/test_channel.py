"""The notice and status files the supervisor and the sidecar share."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cairn.exceptions import ConfigError
from cairn.runtime import channel
from cairn.runtime.channel import Notice, RunStatus


def test_a_notice_is_taken_once(tmp_path: Path) -> None:
    path = str(tmp_path / channel.NOTICE_NAME)
    assert channel.take_notice(path) is None
    notice = Notice(source="gce-preempted", reason="instance/preempted is TRUE",
                    issued_at=100.0, deadline=115.0)
    channel.write_notice(path, notice)
    assert channel.read_notice(path) == notice  # reading leaves it pending
    assert channel.take_notice(path) == notice
    assert channel.take_notice(path) is None  # taken: a restarted supervisor does not redo it
    assert (tmp_path / channel.TAKEN_NAME).exists()
    assert notice.seconds_left(now=110.0) == 5.0


def test_writes_are_atomic_and_readable_by_the_other_user(tmp_path: Path) -> None:
    path = tmp_path / channel.STATUS_NAME
    channel.write_status(str(path), RunStatus(pid=1, started_at=5.0, snapshots=2))
    channel.write_status(str(path), RunStatus(pid=1, started_at=5.0, snapshots=3))
    assert sorted(os.listdir(tmp_path)) == [channel.STATUS_NAME]  # no temporaries left
    assert path.stat().st_mode & 0o777 == 0o644
    status = channel.read_status(str(path))
    assert status is not None and status.snapshots == 3


def test_a_status_from_a_newer_writer_keeps_what_it_knows(tmp_path: Path) -> None:
    path = tmp_path / channel.STATUS_NAME
    path.write_text(json.dumps({"version": 1, "pid": 7, "started_at": 1.0, "snapshots": 4,
                                "a_field_from_the_future": True}))
    status = channel.read_status(str(path))
    assert status is not None and status.snapshots == 4 and status.pid == 7


@pytest.mark.parametrize("doc,message", [
    ({"version": 2, "source": "x", "reason": "y", "issued_at": 1, "deadline": 2},
     "same cairn version"),
    ({"version": 1, "source": "x", "reason": "y", "issued_at": 1}, "malformed notice"),
    ({"version": 1, "source": "x", "reason": "y", "issued_at": 1, "deadline": "soon"},
     "malformed notice"),
    ({"version": 1, "source": "x", "reason": "y", "issued_at": 1, "deadline": float("inf")},
     "finite"),
])
def test_a_bad_notice_is_named(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / channel.NOTICE_NAME
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message):
        channel.read_notice(str(path))


def test_a_torn_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / channel.NOTICE_NAME
    path.write_text('{"version": 1, "sou')
    with pytest.raises(ConfigError, match="not a readable cairn channel file"):
        channel.read_notice(str(path))
