"""Crash consistency with real processes: a snapshot writer SIGKILLed at a random moment.

The writer (:mod:`tests.support.crash_writer`) commits seeded snapshots of one key in a loop
and acknowledges each commit in a fsynced file. A seeded random delay after it starts, it is
killed, landing anywhere in chunking, pack writes and fsyncs, publishing, record creation or
retention pruning. Whatever the moment, the store must show only complete snapshots, lose none
that was acknowledged, and take the next attempt's writes.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cairn.exceptions import NoSnapshot
from cairn.store.store import SnapshotInfo, Store
from cairn import open_store
from tests.support.crash_writer import (
    KEY,
    SETTINGS,
    STORE_URL_ENV,
    ack_path,
    snapshot_files,
    store_dir,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
KILL_WINDOW_S = 1.0  # the writer commits about 8 snapshots a second here
S3_KILL_WINDOW_S = 3.0


@dataclass
class KilledRun:
    workdir: Path
    seed: int
    acks: list[tuple[int, int]]  # (seq, n) of every acknowledged commit, in order
    store_url: str | None = None

    @property
    def store_dir(self) -> str:
        return self.store_url or store_dir(str(self.workdir))


def run_and_kill(workdir: Path, seed: int, *, store_url: str | None = None) -> KilledRun:
    """Start the writer, SIGKILL it a seeded random delay after it is ready, read its acks.
    ``store_url``: the writer's store instead of one in ``workdir`` (S3 through moto's
    server commits about 3 snapshots a second: its kills spread over a longer window)."""
    window = KILL_WINDOW_S if store_url is None else S3_KILL_WINDOW_S
    delay = random.Random(seed).uniform(0.0, window)
    stderr_path = workdir / "writer.stderr"
    env = dict(os.environ, **({STORE_URL_ENV: store_url} if store_url else {}))
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.crash_writer", str(workdir), str(seed)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, env=env,
        )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready == b"ready\n", stderr_path.read_text()
        time.sleep(delay)
        assert proc.poll() is None, f"the writer exited early:\n{stderr_path.read_text()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return KilledRun(workdir, seed, read_acks(ack_path(str(workdir))), store_url)


def read_acks(path: str) -> list[tuple[int, int]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="ascii") as f:
        lines = [line for line in f if line.endswith("\n")]  # a torn last line was not acked
    return [(int(seq), int(n)) for seq, n in (line.split() for line in lines)]


def tree(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            out[path.relative_to(root).as_posix()] = path.read_bytes()
    return out


def number_of(info: SnapshotInfo) -> int:
    """The writer's snapshot number ``n``, which it put in the snapshot's user metadata."""
    return int(info.manifest.metadata["user"]["n"])


def assert_snapshots_exact(store: Store, seed: int, scratch: Path) -> list[SnapshotInfo]:
    """Every retained snapshot restores bit-exact and verifies; the newest restores without
    falling back. Returns the snapshots, newest first."""
    snaps = store.snapshots(KEY)
    if not snaps:
        with pytest.raises(NoSnapshot):
            store.restore(KEY, scratch / "none")
        return snaps
    result = store.restore(KEY, scratch / "latest")
    assert (result.manifest.seq, result.skipped) == (snaps[0].seq, ())
    assert tree(scratch / "latest") == snapshot_files(seed, number_of(snaps[0]))
    for info in snaps[1:]:
        dest = scratch / f"seq-{info.seq}"
        store.restore(KEY, dest, seq=info.seq)
        assert tree(dest) == snapshot_files(seed, number_of(info)), f"seq {info.seq}"
    report = store.verify(KEY)
    assert report.ok, report.results
    assert sorted(report.results) == sorted(info.seq for info in snaps)
    return snaps


@pytest.mark.parametrize("seed", range(50))
def test_sigkill_never_exposes_a_partial_snapshot_nor_loses_an_acked_one(
        tmp_path: Path, seed: int) -> None:
    """After a SIGKILL anywhere, every visible snapshot is complete and bit-exact, the newest
    is the last acknowledged one or the one commit after it, and nothing acked is lost."""
    check_killed_run(run_and_kill(tmp_path, seed), seed, tmp_path)


@pytest.mark.parametrize("seed", range(200, 210))
def test_sigkill_on_s3_never_exposes_a_partial_snapshot_nor_loses_an_acked_one(
        tmp_path: Path, seed: int, s3_bucket: str) -> None:
    """The same kill trials on an S3 store (moto's server, a fake of S3): multipart-free
    create-only puts, touches by copy and retention's deletes cut anywhere."""
    url = f"s3://{s3_bucket}/crash-{seed}"
    check_killed_run(run_and_kill(tmp_path, seed, store_url=url), seed, tmp_path)


def check_killed_run(run: KilledRun, seed: int, tmp_path: Path) -> None:
    seqs = [seq for seq, _ in run.acks]
    assert [n for _, n in run.acks] == list(range(len(run.acks)))
    assert seqs == sorted(set(seqs))

    with open_store(run.store_dir, settings=SETTINGS) as store:
        snaps = assert_snapshots_exact(store, seed, tmp_path / "restored")
    visible = [info.seq for info in snaps]
    assert len(visible) <= SETTINGS.keep_last + 1  # a kill may land between commit and prune
    if run.acks:
        assert seqs[-1] in visible, f"acknowledged seq {seqs[-1]} is lost; visible {visible}"
        assert visible[0] in (seqs[-1], seqs[-1] + 1)
    else:
        assert len(visible) <= 1  # at most the first commit, killed before its ack
    acked = dict(run.acks)
    for info in snaps:  # a seq holds the snapshot acked for it; only the next one is unacked
        assert number_of(info) == acked.get(info.seq, len(run.acks)), f"seq {info.seq}"
    shutil.rmtree(tmp_path)  # passed: free the disk (a failure keeps it to inspect)


@pytest.mark.parametrize("seed", range(100, 106))
def test_next_attempt_after_a_kill_commits_and_gc_cleans_up(tmp_path: Path, seed: int) -> None:
    """A kill leaves no wedge: the next attempt resumes from the newest snapshot, commits a
    new one, and GC with no grace removes the debris while every retained snapshot verifies."""
    run = run_and_kill(tmp_path, seed)
    resume_and_collect(run, seed, tmp_path)
    leftovers = [name for _, _, names in os.walk(run.store_dir) for name in names
                 if name.startswith((".tmp.", ".gc."))]
    assert leftovers == []
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("seed", range(300, 303))
def test_next_attempt_after_a_kill_on_s3_commits_and_gc_cleans_up(
        tmp_path: Path, seed: int, s3_bucket: str) -> None:
    """The same on S3, whose GC condemns unused packs in one pass and deletes them in the next
    (ADR 0048): with no grace, two passes leave only the retained snapshots' packs."""
    run = run_and_kill(tmp_path, seed, store_url=f"s3://{s3_bucket}/crash-{seed}")
    resume_and_collect(run, seed, tmp_path)


def resume_and_collect(run: KilledRun, seed: int, tmp_path: Path) -> None:
    with open_store(run.store_dir, settings=SETTINGS) as store:
        before = store.snapshots(KEY)
        attempt = store.open_attempt(KEY)
        assert (attempt.parent.seq if attempt.parent else None) == \
            (before[0].seq if before else None)
        n = number_of(before[0]) + 1 if before else 0
        with attempt.snapshot() as snap:
            for path, data in snapshot_files(seed, n).items():
                snap.add_bytes(path, data)
            manifest = snap.commit(user={"n": n})
        assert manifest.seq > max([info.seq for info in before], default=0)

        step = store.backend.version_resolution_seconds  # S3: ages count from the second's end
        time.sleep(step and step + 0.2)
        store.gc(grace_seconds=0)
        if not store.backend.guarded_deletes:  # the condemned packs are due a step later
            time.sleep(step + 0.2)
            store.gc(grace_seconds=0)
        snaps = assert_snapshots_exact(store, seed, tmp_path / "restored")
        assert snaps[0].seq == manifest.seq and len(snaps) <= SETTINGS.keep_last
        referenced = set().union(*(info.manifest.packs() for info in snaps))
        assert {info.name for info in store.backend.list("packs/")} == referenced
        assert list(store.backend.list("gc/")) == []
