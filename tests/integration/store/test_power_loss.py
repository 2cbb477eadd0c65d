"""Power loss at every point of a recorded run, under the pessimistic durability model.

A store runs on :class:`~tests.support.powerloss.RecordingFileOps`; for every prefix of the
recorded operations, :func:`~tests.support.powerloss.replay_durable` rebuilds what a power loss
there could leave, and the rebuilt store must keep every snapshot whose commit had returned,
bit-exact, and must show no snapshot that references data which was not yet durable.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from cairn.store.keys import Key
from cairn.store.local import LocalBackend
from cairn.store.settings import StoreSettings
from cairn.store.store import Store
from tests.support.powerloss import LossyFileOps, Op, RecordingFileOps, replay_durable

# Small chunks and packs, so that each snapshot spans several packs and pack directories.
SETTINGS = StoreSettings(max_chunk_bytes=16 << 10, pack_bytes=48 << 10, max_inflight_packs=2,
                         io_threads=2)
KEY = Key.parse("dag/train/run-1/0")


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


SNAP_A = {"model/weights.bin": blob(1, 100_000), "config.json": b'{"lr": 0.1}', "empty.txt": b""}
SNAP_B = {
    # The first three chunks repeat A's (dedup against the parent), the rest is new.
    "model/weights.bin": SNAP_A["model/weights.bin"][: 48 << 10] + blob(2, 60_000),
    "optim/state.bin": blob(3, 40_000),
    "config.json": b'{"lr": 0.05}',
}
SNAP_C_PARTIAL = blob(4, 120_000)


def tree(root: Path, *, dirs: bool = False) -> dict[str, bytes | None]:
    """Every file under ``root`` with its bytes (and, with ``dirs``, each directory as None)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if dirs:
            out.update({(rel / d).as_posix(): None for d in dirnames})
        for name in filenames:
            out[(rel / name).as_posix()] = (Path(dirpath) / name).read_bytes()
    return out


@dataclass
class Recording:
    ops: list[Op]
    acked_at: dict[int, int]  # seq -> number of operations recorded when its commit returned
    contents: dict[int, dict[str, bytes]]  # seq -> the files it holds


def record_run(root: Path, fileops: RecordingFileOps) -> Recording:
    """Open a store, commit A, commit B, then lose power in the middle of C."""
    acked_at: dict[int, int] = {}
    contents: dict[int, dict[str, bytes]] = {}
    with Store(LocalBackend(str(root), fileops=fileops), settings=SETTINGS) as store:
        attempt = store.open_attempt(KEY)
        for files in (SNAP_A, SNAP_B):
            with attempt.snapshot() as snap:
                for path, data in files.items():
                    snap.add_bytes(path, data)
                manifest = snap.commit()
            acked_at[manifest.seq] = fileops.count()
            contents[manifest.seq] = files
        with attempt.snapshot() as snap:
            snap.add_bytes("partial.bin", SNAP_C_PARTIAL)  # fills and seals packs
            ops = fileops.stop()  # the power goes out here: C never commits
    return Recording(ops, acked_at, contents)


def violations(rec: Recording, upto: int, scratch: Path) -> list[str]:
    """Replay a power loss after ``rec.ops[:upto]``; every way the rebuilt store breaks the
    durability promise (empty when it keeps it)."""
    disk = scratch / "disk"
    disk.mkdir(parents=True)
    replay_durable(rec.ops, upto, str(disk))
    must_keep = {seq for seq, at in rec.acked_at.items() if at <= upto}
    problems: list[str] = []
    try:
        with Store(LocalBackend(str(disk)), settings=SETTINGS) as store:
            visible = {info.seq for info in store.snapshots(KEY)}
            problems += [f"acknowledged seq {seq} is lost" for seq in sorted(must_keep - visible)]
            for seq in sorted(visible):
                if seq not in rec.contents:
                    problems.append(f"seq {seq} is visible but its commit never started")
                    continue
                dest = scratch / f"restore-{seq}"
                try:
                    store.restore(KEY, dest, seq=seq)
                except Exception as e:  # noqa: BLE001 - any failure is a violation
                    problems.append(f"seq {seq} does not restore: {e}")
                    continue
                if tree(dest) != rec.contents[seq]:
                    problems.append(f"seq {seq} restored different bytes")
            report = store.verify(KEY)
            problems += [f"verify seq {seq}: {why}" for seq, why in report.results.items() if why]
    except Exception as e:  # noqa: BLE001 - a store that no longer opens or lists is broken
        problems.append(f"the store is unusable: {type(e).__name__}: {e}")
    shutil.rmtree(scratch)
    return problems


def first_violation(rec: Recording, scratch: Path) -> tuple[int, list[str]] | None:
    for upto in range(len(rec.ops) + 1):
        problems = violations(rec, upto, scratch / str(upto))
        if problems:
            return upto, problems
    return None


def test_replay_keeps_only_what_was_synced(tmp_path: Path) -> None:
    """The model itself: data survives as of its file's fsync, a name only after its
    directory's fsync_dir, and a link shares the inode's durable data."""
    ops = [
        Op("open_new", ".tmp.a", fd=5), Op("write", ".tmp.a", fd=5, data=b"hello"),
        Op("fsync", ".tmp.a", fd=5), Op("write", ".tmp.a", fd=5, data=b" lost"),
        Op("close", ".tmp.a", fd=5), Op("link", ".tmp.a", "a"), Op("unlink", ".tmp.a"),
        Op("fsync_dir", ""),  # 8: "a" is durable, with the fsynced bytes only
        Op("mkdir", "d"), Op("open_new", "d/b", fd=5), Op("write", "d/b", fd=5, data=b"x"),
        Op("close", "d/b", fd=5), Op("fsync_dir", "d"),  # 13: "d" itself is not durable yet
        Op("rename", "a", "d/c"), Op("fsync_dir", ""),  # 15: "d" durable, "a" gone, "c" not yet
        Op("fsync_dir", "d"),  # 16
    ]
    expected: dict[int, dict[str, bytes | None]] = {
        7: {},
        8: {"a": b"hello"},
        13: {"a": b"hello"},
        15: {"d": None, "d/b": b""},
        16: {"d": None, "d/b": b"", "d/c": b"hello"},
    }
    for upto, state in expected.items():
        target = tmp_path / str(upto)
        target.mkdir()
        replay_durable(ops, upto, str(target))
        assert tree(target, dirs=True) == state, f"after {upto} operations"


def test_every_power_loss_point_keeps_acknowledged_snapshots(tmp_path: Path) -> None:
    """After a power loss at any recorded operation, every snapshot whose commit had returned
    restores bit-exact, and every visible snapshot verifies."""
    root = tmp_path / "store"
    root.mkdir()
    rec = record_run(root, RecordingFileOps(str(root)))
    names = {op.name for op in rec.ops}
    assert {"open_new", "write", "fsync", "link", "unlink", "mkdir", "fsync_dir"} <= names
    assert len(rec.acked_at) == 2 and max(rec.acked_at.values()) < len(rec.ops)

    failures = {}
    for upto in range(len(rec.ops) + 1):
        problems = violations(rec, upto, tmp_path / "check" / str(upto))
        if problems:
            failures[upto] = (rec.ops[upto - 1] if upto else None, problems)
    assert not failures, failures


@pytest.mark.parametrize(
    ("skip", "under", "symptom"),
    [
        ("fsync", "packs/", "does not restore"),  # a visible snapshot's pack data is lost
        ("fsync_dir", "packs/", "does not restore"),  # ... its pack's name is lost
        ("fsync", "keys/", "is lost"),  # the acknowledged record's bytes are lost
        ("fsync_dir", "keys/", "is lost"),  # ... its name is lost
    ],
)
def test_simulator_detects_a_missing_sync(tmp_path: Path, skip: str, under: str,
                                          symptom: str) -> None:
    """The check has teeth: a backend that skips one kind of sync is caught at some prefix."""
    root = tmp_path / "store"
    root.mkdir()
    rec = record_run(root, LossyFileOps(str(root), skip=skip, under=under))
    found = first_violation(rec, tmp_path / "check")
    assert found is not None, f"skipping {skip} under {under} went unnoticed"
    upto, problems = found
    assert any(symptom in p for p in problems), (upto, problems)


def test_directory_left_by_a_killed_writer_is_made_durable(tmp_path: Path) -> None:
    """A writer killed between ``mkdir`` and its parent's ``fsync_dir`` leaves a directory that
    is not durable. The next writer finds it and uses it; its commit must still survive a
    power loss."""
    root = tmp_path / "store"
    root.mkdir()
    rec = RecordingFileOps(str(root))
    key_a, key_b = Key.parse("dag/a"), Key.parse("dag/b")
    with Store(LocalBackend(str(root), fileops=rec), settings=SETTINGS) as store:
        with store.open_attempt(key_a).snapshot() as snap:
            snap.add_bytes("a.bin", blob(5, 30_000))
            snap.commit()
    rec.mkdir(str(root / "keys" / "dag" / "b"))  # a writer of dag/b is SIGKILLed right here
    with Store(LocalBackend(str(root), fileops=rec), settings=SETTINGS) as store:
        with store.open_attempt(key_b).snapshot() as snap:
            snap.add_bytes("b.bin", blob(6, 30_000))
            manifest = snap.commit()

    disk = tmp_path / "disk"
    disk.mkdir()
    replay_durable(rec.ops, len(rec.ops), str(disk))
    with Store(LocalBackend(str(disk)), settings=SETTINGS) as replayed:
        assert [info.seq for info in replayed.snapshots(key_b)] == [manifest.seq]
