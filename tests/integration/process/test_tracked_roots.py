"""Tamper tests: a process snapshot crafted by whoever can write the bucket names tracked files
a restore (root, broad capabilities) must not write. Each runs on a real store on both backends
(local and the fake-gcs-server process) through :func:`cairn.process.snapshot.fetch`, the
restore path ``cairn run`` takes, and checks three things: it refuses, it logs why, and nothing
outside the roots changed. A legitimate snapshot restores next to them, so a refusal is not a
restore that does nothing. Then the dump side: ``cairn run`` (real CRIU) refuses a workload
appending outside the roots and names CAIRN_TRACK_ROOTS, and accepts it once that is set.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from cairn.exceptions import NotSnapshottable, UnsafePath
from cairn.process import snapshot as snap_mod
from cairn.process.snapshot import TRACK_ROOTS_ENV, check_tracked, track_roots
from cairn.store import Key, SnapshotMode, Store

pytestmark = pytest.mark.isolated  # CRIU restores at fixed PIDs (make test: in a PID namespace of its own)

KEY = Key.parse("dag/train/run-1/0")


@pytest.fixture()
def place(tmp_path: Path) -> dict[str, Path]:
    work = tmp_path / "work"  # the step's working directory
    run = tmp_path / "cairn-run"  # cairn's log directory
    outside = tmp_path / "outside"  # stands for /etc, /root/.ssh, another step's files
    for d in (work, run, outside):
        d.mkdir()
    (outside / "victim").write_bytes(b"precious")
    (work / "metrics.txt").write_bytes(b"step 1\nstep 2\nstep 3, not yet dumped\n")
    return {"work": work, "run": run, "outside": outside, "staging": run / "staging"}


def _craft(store: Store, tracked: list[tuple[str, bytes]], *, image_mode: int | None = None
           ) -> object:
    """Commit a process snapshot whose manifest names ``tracked`` (path, content) files, as a
    bucket writer with cairn's own library could."""
    attempt = store.open_attempt(KEY)
    with attempt.snapshot(mode=SnapshotMode.PROCESS) as snap:
        snap.add_bytes("images/inventory.img", b"\x00" * 64, mode=image_mode)
        for index, (_path, data) in enumerate(tracked):
            snap.add_bytes(f"files/{index}", data)
        user = {"process": {"root_pid": 4242, "pids": [4242],
                            "tracked": [{"path": p, "size": len(d)} for p, d in tracked]}}
        return snap.commit(compat={}, user=user)


def _tree(path: Path) -> dict[str, bytes | str]:
    """Every entry under ``path``: file content, or what a non-file is."""
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        st = os.lstat(p)
        rel = str(p.relative_to(path))
        out[rel] = p.read_bytes() if stat.S_ISREG(st.st_mode) else stat.filemode(st.st_mode)
    return out


def _fetch_refused(store: Store, manifest: object, place: dict[str, Path],
                   caplog: pytest.LogCaptureFixture, match: str) -> None:
    outside_before = _tree(place["outside"])
    metrics_before = (place["work"] / "metrics.txt").read_bytes()
    with caplog.at_level(logging.ERROR, logger="cairn.run"):
        with pytest.raises(UnsafePath, match=match):
            snap_mod.fetch(store, manifest, str(place["staging"] / "restore-1"),  # type: ignore[arg-type]
                           roots=[str(place["work"]), str(place["run"])])
    assert "refusing snapshot seq" in caplog.text and match.split("|")[0] in caplog.text
    assert _tree(place["outside"]) == outside_before
    # All targets are opened before any is rewritten: the legitimate one is untouched too.
    assert (place["work"] / "metrics.txt").read_bytes() == metrics_before
    shutil.rmtree(place["staging"], ignore_errors=True)  # as the supervisor does


def test_legitimate_tracked_files_are_put_back(store: Store, place: dict[str, Path]) -> None:
    metrics, log = place["work"] / "metrics.txt", place["run"] / "abc" / "stdout.log"
    manifest = _craft(store, [(str(metrics), b"step 1\nstep 2\n"), (str(log), b"hello\n")])
    ino = os.stat(metrics).st_ino
    tracked = snap_mod.fetch(store, manifest, str(place["staging"] / "restore-1"),  # type: ignore[arg-type]
                             roots=[str(place["work"]), str(place["run"])])
    assert [t.path for t in tracked] == [str(metrics), str(log)]
    assert metrics.read_bytes() == b"step 1\nstep 2\n"  # cut back to the dumped size
    assert os.stat(metrics).st_ino == ino  # in place: CRIU reopens it by path
    assert log.read_bytes() == b"hello\n"  # written afresh where the node never had it


def test_absolute_path_outside_the_roots(store: Store, place: dict[str, Path],
                                         caplog: pytest.LogCaptureFixture) -> None:
    manifest = _craft(store, [(str(place["work"] / "metrics.txt"), b"x"),
                              (str(place["outside"] / "victim"), b"owned")])
    _fetch_refused(store, manifest, place, caplog, "outside the track roots")
    assert not (place["staging"] / "restore-1").exists()  # refused before any download


def test_path_with_dotdot(store: Store, place: dict[str, Path],
                          caplog: pytest.LogCaptureFixture) -> None:
    manifest = _craft(store, [(str(place["work"] / "metrics.txt"), b"x"),
                              (f"{place['work']}/../outside/victim", b"owned")])
    _fetch_refused(store, manifest, place, caplog, "not normal")


def test_symlink_planted_in_the_working_directory(store: Store, place: dict[str, Path],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    (place["work"] / "logs").symlink_to(place["outside"])
    (place["work"] / "run.log").symlink_to(place["outside"] / "victim")
    for planted in ("logs/victim", "logs/new.log", "run.log"):
        manifest = _craft(store, [(str(place["work"] / "metrics.txt"), b"x"),
                                  (f"{place['work']}/{planted}", b"owned")])
        _fetch_refused(store, manifest, place, caplog, "symlink")
        caplog.clear()


def test_device_file(store: Store, place: dict[str, Path],
                     caplog: pytest.LogCaptureFixture) -> None:
    manifest = _craft(store, [(str(place["work"] / "metrics.txt"), b"x"), ("/dev/null", b"x")])
    _fetch_refused(store, manifest, place, caplog, "outside the track roots")
    if os.geteuid() == 0:  # a device node planted inside a root
        os.mknod(place["work"] / "tty", stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
        caplog.clear()
        manifest = _craft(store, [(str(place["work"] / "metrics.txt"), b"x"),
                                  (str(place["work"] / "tty"), b"x")])
        _fetch_refused(store, manifest, place, caplog, "a device")


def test_hard_link_to_a_file_outside(store: Store, place: dict[str, Path],
                                     caplog: pytest.LogCaptureFixture) -> None:
    os.link(place["outside"] / "victim", place["work"] / "linked.log")
    manifest = _craft(store, [(str(place["work"] / "metrics.txt"), b"x"),
                              (str(place["work"] / "linked.log"), b"owned")])
    _fetch_refused(store, manifest, place, caplog, "hard links")
    assert (place["outside"] / "victim").read_bytes() == b"precious"


def test_setuid_mode_is_masked(store: Store, place: dict[str, Path],
                               caplog: pytest.LogCaptureFixture) -> None:
    manifest = _craft(store, [], image_mode=0o4755)
    dest = place["staging"] / "restore-1"
    with caplog.at_level(logging.WARNING, logger="cairn.store"):
        snap_mod.fetch(store, manifest, str(dest),  # type: ignore[arg-type]
                       roots=[str(place["work"]), str(place["run"])])
    assert stat.S_IMODE(os.stat(dest / "images" / "inventory.img").st_mode) == 0o755
    assert "mode 4755 of images/inventory.img masked to 0755" in caplog.text


def test_default_roots_are_the_cwd_the_run_directory_and_the_env(
        store: Store, place: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without explicit roots (today's supervisor), the run directory is the one holding the
    staging directory, and CAIRN_TRACK_ROOTS adds more."""
    extra = place["outside"] / "declared"
    monkeypatch.chdir(place["work"])
    monkeypatch.setenv(TRACK_ROOTS_ENV, f"{extra}{os.pathsep}{place['outside'] / 'other'}")
    manifest = _craft(store, [(str(place["work"] / "metrics.txt"), b"a"),
                              (str(place["run"] / "k" / "stderr.log"), b"b"),
                              (str(extra / "train.log"), b"c")])
    snap_mod.fetch(store, manifest, str(place["staging"] / "restore-1"))  # type: ignore[arg-type]
    assert (extra / "train.log").read_bytes() == b"c"
    monkeypatch.delenv(TRACK_ROOTS_ENV)
    manifest = _craft(store, [(str(extra / "train.log"), b"d")])
    with pytest.raises(UnsafePath, match="outside the track roots"):
        snap_mod.fetch(store, manifest, str(place["staging"] / "restore-2"))  # type: ignore[arg-type]
    assert (extra / "train.log").read_bytes() == b"c"


def test_track_roots_refuses_relative_entries_and_slash(tmp_path: Path) -> None:
    with pytest.raises(UnsafePath, match="not an absolute path"):
        track_roots(log_dir=str(tmp_path), environ={TRACK_ROOTS_ENV: "logs"})
    with pytest.raises(UnsafePath, match="confines nothing"):
        track_roots(log_dir=str(tmp_path), environ={TRACK_ROOTS_ENV: "/"})


def test_dump_side_check_names_the_fix(tmp_path: Path) -> None:
    roots = track_roots(log_dir=str(tmp_path / "run"), cwd=str(tmp_path / "work"), environ={})
    check_tracked([str(tmp_path / "work" / "m.txt"), str(tmp_path / "run" / "x.log")],
                  roots=roots)
    with pytest.raises(NotSnapshottable) as info:
        check_tracked([str(tmp_path / "work" / "m.txt"), "/var/log/train/metrics.txt"],
                      roots=roots)
    assert "/var/log/train/metrics.txt" in str(info.value)
    assert f"{TRACK_ROOTS_ENV}=/var/log/train" in str(info.value)


# -- the dump side, end to end with real CRIU ---------------------------------------------------

def test_cairn_run_refuses_a_file_outside_the_roots_until_it_is_declared(tmp_path: Path) -> None:
    from tests.support.cairn_run import COUNTER, CairnRun, can_run_criu, wait_for

    if not can_run_criu():
        pytest.skip("needs root and a criu binary (make criu)")
    work, outside = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    outside.mkdir()
    metrics = outside / "metrics.txt"
    command = [sys.executable, str(COUNTER), str(metrics), "100000", "0.05"]
    run = CairnRun(store=str(tmp_path / "store"), key="dag/train/roots", command=command,
                   workdir=work / "cairn", logs=tmp_path / "logs", every="0.5s", cwd=work)
    try:
        wait_for(lambda: "snapshot failed" in run.stderr or run.proc.poll() is not None, 120,
                 "the first dump")
        assert run.proc.poll() is None, run.stderr
        assert f"{metrics}, outside the track roots" in run.stderr
        assert f"set {TRACK_ROOTS_ENV}={outside}" in run.stderr
    finally:
        run.kill()
    declared = CairnRun(store=str(tmp_path / "store"), key="dag/train/roots", command=command,
                        workdir=work / "cairn", logs=tmp_path / "logs", every="0.5s", cwd=work,
                        env={TRACK_ROOTS_ENV: str(outside)})
    try:
        wait_for(lambda: declared.committed() or declared.proc.poll() is not None, 120,
                 "a snapshot")
        assert declared.committed(), declared.stderr
    finally:
        declared.kill()


def test_cairn_run_skips_a_crafted_snapshot_saying_why_and_starts_fresh(
        backend_url: str, tmp_path: Path) -> None:
    """The whole restore path: a bucket writer commits a process snapshot that fits this host
    (a copied compatibility record) and names a file outside the roots; `cairn run` refuses it
    before CRIU sees it, logs why, starts the command fresh, and the file is untouched."""
    from cairn.process import compat as compat_mod
    from cairn import open_store
    from tests.support.cairn_run import COUNTER, CRIU, CairnRun, can_run_criu

    if not can_run_criu():
        pytest.skip("needs root and a criu binary (make criu)")
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    key = "dag/train/crafted"
    command = [sys.executable, str(COUNTER), str(work / "metrics.txt"), "20", "0.01"]
    with open_store(backend_url) as store:
        attempt = store.open_attempt(Key.parse(key))
        with attempt.snapshot(mode=SnapshotMode.PROCESS) as snap:
            snap.add_bytes("images/inventory.img", b"\x00" * 64)
            snap.add_bytes("files/0", b"owned")
            crafted = snap.commit(
                compat=compat_mod.current_record(command, cwd=str(work), criu=CRIU),
                user={"process": {"root_pid": 4242, "pids": [], "tracked": [
                    {"path": str(outside / "victim"), "size": 5}]}})
    # On an unencrypted bucket root runs only with the opt-out (ADR 0025); the track roots
    # are the line of defence this test is about.
    run = CairnRun(store=backend_url, key=key, command=command, workdir=work / "cairn",
                   logs=tmp_path / "logs", every="10m", cwd=work,
                   env={"CAIRN_ALLOW_UNAUTHENTICATED_RESTORE": "1"})
    assert run.wait() == 0, run.stderr
    assert f"skipping snapshot seq {crafted.seq}: seq {crafted.seq}: tracked file refused" in \
        run.stderr and "outside the track roots" in run.stderr
    assert "starting fresh" in run.stderr
    assert (outside / "victim").read_bytes() == b"precious"
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert len((work / "metrics.txt").read_text().splitlines()) == 20
