"""Confined writes (cairn.store.confined): every refusal, with openat2 and with the portable walk."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot, UnsafePath
from cairn.store import confined
from cairn.store.confined import Confinement, masked_mode, normalize_roots, open_beneath, \
    split_under


@pytest.fixture(params=["openat2", "walk"])
def how(request: pytest.FixtureRequest) -> Confinement:
    if request.param == "openat2":
        slash = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        try:
            fd = confined._openat2(slash, ".", os.O_RDONLY | os.O_DIRECTORY, 0)
        finally:
            os.close(slash)
        if fd is None:
            pytest.skip("this kernel has no openat2 (Linux < 5.6)")
        os.close(fd)
    return Confinement(use_openat2=request.param == "openat2")


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "outside"
    o.mkdir()
    (o / "victim").write_bytes(b"precious")
    return o


def _write(root: Path, name: str, data: bytes, how: Confinement) -> None:
    fd = open_beneath(str(root), name, how=how)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, data)
    finally:
        os.close(fd)


def test_writes_beneath_the_root_creating_directories(root: Path, how: Confinement) -> None:
    _write(root, "a/b/c.log", b"hello", how)
    assert (root / "a" / "b" / "c.log").read_bytes() == b"hello"
    _write(root, "a/b/c.log", b"again", how)  # an existing regular file is rewritten in place
    assert (root / "a" / "b" / "c.log").read_bytes() == b"again"


def test_existing_file_keeps_its_inode_mode_and_owner(root: Path, how: Confinement) -> None:
    target = root / "metrics.txt"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    before = os.stat(target)
    _write(root, "metrics.txt", b"new", how)
    after = os.stat(target)
    assert (after.st_ino, stat.S_IMODE(after.st_mode), after.st_uid) == \
        (before.st_ino, 0o600, before.st_uid)


@pytest.mark.parametrize("name", ["../outside/victim", "a/../../outside/victim", "/etc/passwd",
                                  "a//b", "./a", "", "a/\x00b"])
def test_refuses_names_that_are_not_plain_relative_paths(root: Path, outside: Path,
                                                         how: Confinement, name: str) -> None:
    with pytest.raises(UnsafePath):
        open_beneath(str(root), name, how=how)
    assert (outside / "victim").read_bytes() == b"precious"
    assert list(root.iterdir()) == []


def test_refuses_a_symlinked_directory_component(root: Path, outside: Path,
                                                 how: Confinement) -> None:
    (root / "logs").symlink_to(outside)
    with pytest.raises(UnsafePath, match="symlink"):
        open_beneath(str(root), "logs/victim", how=how)
    with pytest.raises(UnsafePath, match="symlink"):
        open_beneath(str(root), "logs/new-file", how=how)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"precious"


def test_refuses_a_symlink_deeper_down(root: Path, outside: Path, how: Confinement) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "c").symlink_to(outside)
    with pytest.raises(UnsafePath, match="symlink"):
        open_beneath(str(root), "a/b/c/victim", how=how)
    assert (outside / "victim").read_bytes() == b"precious"


def test_refuses_a_symlink_as_the_file_itself(root: Path, outside: Path,
                                              how: Confinement) -> None:
    (root / "metrics.txt").symlink_to(outside / "victim")
    with pytest.raises(UnsafePath, match="symlink"):
        open_beneath(str(root), "metrics.txt", how=how)
    (root / "dangling").symlink_to(outside / "not-yet")
    with pytest.raises(UnsafePath, match="symlink"):
        open_beneath(str(root), "dangling", how=how)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_refuses_a_hard_link(root: Path, outside: Path, how: Confinement) -> None:
    os.link(outside / "victim", root / "metrics.txt")
    with pytest.raises(UnsafePath, match="hard links"):
        open_beneath(str(root), "metrics.txt", how=how)
    assert (outside / "victim").read_bytes() == b"precious"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_refuses_a_device(root: Path, how: Confinement) -> None:
    null = os.stat("/dev/null").st_rdev
    os.mknod(root / "dev-null", stat.S_IFCHR | 0o666, null)
    with pytest.raises(UnsafePath, match="a device"):
        open_beneath(str(root), "dev-null", how=how)


def test_refuses_a_fifo_without_blocking_and_a_directory(root: Path, how: Confinement) -> None:
    os.mkfifo(root / "pipe")
    with pytest.raises(UnsafePath, match="not a regular file"):
        open_beneath(str(root), "pipe", how=how)
    (root / "dir").mkdir()
    with pytest.raises(UnsafePath, match="directory"):
        open_beneath(str(root), "dir", how=how)


def test_refuses_truncating_before_the_checks(root: Path) -> None:
    with pytest.raises(ValueError, match="truncate"):
        open_beneath(str(root), "x", flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC)


def test_an_unsafe_path_is_a_corrupt_snapshot() -> None:
    # A restore skips a snapshot naming one, as it skips a corrupt one.
    assert issubclass(UnsafePath, CorruptSnapshot)


def test_masked_mode_drops_setuid_setgid_sticky_and_says_so(caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    with caplog.at_level(logging.WARNING, logger="cairn.store"):
        assert masked_mode(0o4755, path="bin/tool") == 0o755
        assert masked_mode(0o3777) == 0o777
    assert "mode 4755 of bin/tool masked to 0755" in caplog.text
    caplog.clear()
    assert masked_mode(0o640) == 0o640
    assert caplog.text == ""


def test_split_under_picks_the_longest_root_and_refuses_the_rest(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "cairn").mkdir(parents=True)
    roots = normalize_roots([str(work), str(work / "cairn")])
    assert split_under(f"{work}/cairn/x/stdout.log", roots) == (f"{work}/cairn", "x/stdout.log")
    assert split_under(f"{work}/metrics.txt", roots) == (str(work), "metrics.txt")
    for bad in (f"{work}x/metrics.txt", "/etc/passwd", f"{work}/../etc/passwd",
                f"{work}/./m", f"{work}//m", "relative/m", str(work)):
        with pytest.raises(UnsafePath):
            split_under(bad, roots)


def test_a_root_of_slash_is_refused() -> None:
    with pytest.raises(UnsafePath, match="confines nothing"):
        normalize_roots(["/tmp", "/"])
