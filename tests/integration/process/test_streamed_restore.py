"""Eager restores with real CRIU whose pages are streamed to ``criu restore --stream`` from
verified chunks (:mod:`cairn.process.image_stream`): the step resumes, every step exactly once;
nothing of the pages lands in the scratch directory; a streamed chunk that fails verification
ends the restore and the previous snapshot is used.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from cairn.store import Key
from cairn import open_store
from tests.support.cairn_run import COUNTER, CairnRun, can_run_criu, kill_after_commits, \
    metric_steps
from tests.support.tamper import flip_byte

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]

STEPS = 200
KEY = "dag/streamed/1"


def counter(tmp_path: Path, env: dict[str, str] | None = None) -> CairnRun:
    work = tmp_path / "workspace"
    work.mkdir(exist_ok=True)
    return CairnRun(store=str(tmp_path / "store"), key=KEY,
                    command=[sys.executable, str(COUNTER), str(work / "metrics.txt"), str(STEPS),
                             "0.05"],
                    workdir=work / "cairn", logs=tmp_path / "logs", every="1s",
                    extra=["--restore", "eager"], cwd=tmp_path, env=env)


def interrupted_run(tmp_path: Path, snapshots: int) -> None:
    """A first run killed (supervisor and workload) after ``snapshots`` commits."""
    kill_after_commits(counter(tmp_path), snapshots)


def scratch_files(root: Path) -> set[str]:
    """The names of the files under a restore's scratch directories (``restore-SEQ``) below
    ``root``; the dumps' staging directories are left out."""
    return {name for where, _, names in os.walk(root) if "/restore-" in where
            for name in names}


def test_a_streamed_restore_resumes_every_step_once_without_a_copy_of_its_pages(
        tmp_path: Path) -> None:
    interrupted_run(tmp_path, 2)
    second = counter(tmp_path)
    # What the restore's scratch directories ever hold while the second run restores.
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(scratch_files(tmp_path / "workspace" / "cairn"))
            seen.update(scratch_files(Path("/dev/shm")))
            stop.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert second.wait(300) == 0, second.stderr
    finally:
        stop.set()
        watcher.join()
    assert "), eager, pages streamed" in second.stderr, second.stderr
    assert metric_steps(tmp_path / "workspace" / "metrics.txt") == list(range(STEPS))
    assert any(name.startswith("pagemap-") for name in seen), \
        f"the watcher saw the scratch copy of the small images: {sorted(seen)}"
    assert not any(name.startswith("pages-") for name in seen), sorted(seen)


def pages_chunk_only_in(store_url: str, newest: int, previous: int) -> tuple[str, int]:
    """``(pack, offset)`` of a pages chunk of the newest snapshot that the previous one does
    not share."""
    with open_store(store_url) as store:
        key = Key.parse(KEY)
        new, old = store.manifest(key, newest), store.manifest(key, previous)
        shared = {c.digest for c in old.chunk_refs()}
        for entry in new.files:
            if entry.path.rsplit("/", 1)[-1].startswith("pages-"):
                for chunk in entry.chunks:
                    if chunk.digest not in shared:
                        return chunk.pack, chunk.offset
    raise AssertionError("no pages chunk is unique to the newest snapshot")


def test_a_streamed_chunk_that_fails_verification_falls_back_to_the_previous_snapshot(
        tmp_path: Path) -> None:
    interrupted_run(tmp_path, 3)
    store_url = str(tmp_path / "store")
    with open_store(store_url) as store:
        seqs = [info.seq for info in store.snapshots(Key.parse(KEY))]
        newest, previous = seqs[0], seqs[1]
        pack, offset = pages_chunk_only_in(store_url, newest, previous)
        flip_byte(store.backend, pack, offset)
    # This machine saw the newer one commit: going back to the previous one is a rollback,
    # allowed here (refused otherwise: test_cairn_run.py, ADR 0049).
    second = counter(tmp_path, env={"CAIRN_ALLOW_ROLLBACK": "1"})
    assert second.wait(300) == 0, second.stderr
    err = second.stderr
    assert f"skipping snapshot seq {newest}:" in err and "does not match its digest" in err, err
    assert f"restored snapshot seq {previous} of key" in err, err
    assert metric_steps(tmp_path / "workspace" / "metrics.txt") == list(range(STEPS)), \
        "each step exactly once, the failed restore's lines cut back"
    leftovers = [root for root, _, _ in os.walk(tmp_path / "workspace" / "cairn")
                 if os.path.basename(root).startswith("restore-")]
    assert leftovers == [], "a failed restore's scratch is removed"
