"""A restore makes the directory of a unix socket the (untrusted) images name only where it is
harmless: one new 0700 directory directly in a temporary directory or a track root, never
through a symlink."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from cairn.process.child import Child
from cairn.process.restorer import Restorer
from cairn.process.run_context import RunContext
from cairn.process.run_settings import RunSettings


@pytest.fixture
def restorer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Restorer:
    monkeypatch.chdir(tmp_path)
    settings = RunSettings(store=str(tmp_path / "store"), key="d/t/r", argv=("true",),
                           workdir=str(tmp_path / "work"))
    return Restorer(RunContext(settings), Child())


def test_a_socket_dir_in_tmp_is_made_private(restorer: Restorer) -> None:
    directory = f"/tmp/pymp-{uuid.uuid4().hex}"
    try:
        restorer.prepare_socket_dir(f"{directory}/listener")
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    finally:
        os.rmdir(directory)


def test_a_socket_dir_in_a_track_root_is_made(restorer: Restorer, tmp_path: Path) -> None:
    restorer.prepare_socket_dir(f"{tmp_path}/sockets/listener")  # tmp_path is the cwd: a root
    assert (tmp_path / "sockets").is_dir()


@pytest.mark.parametrize("path", ["/etc/cairn-forged/x.sock", "/tmp/a/b/x.sock",
                                  "/tmp/../etc/cairn-forged/x.sock"])
def test_a_socket_dir_elsewhere_is_not_made(restorer: Restorer, path: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="cairn.run"):
        restorer.prepare_socket_dir(path)
    assert not os.path.exists(os.path.dirname(os.path.normpath(path)))
    assert "not creating" in caplog.text


def test_a_symlinked_parent_is_not_followed(restorer: Restorer, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    restorer.ctx.track_roots = [*restorer.ctx.track_roots, str(tmp_path / "link")]
    with pytest.raises(OSError):
        restorer.prepare_socket_dir(f"{tmp_path}/link/sockets/listener")
    assert list(target.iterdir()) == []
