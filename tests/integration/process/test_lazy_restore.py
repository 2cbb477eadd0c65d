"""``cairn run --restore lazy`` with real CRIU and userfaultfd: the step resumes while its
memory is served from verified chunks by cairn's handler, every step exactly once and every
page bit-identical (through a fork, ``MADV_DONTNEED`` and ``mremap`` in the lazy phase); a
chunk of a lazily served page that fails verification stops the restored workload and the
previous snapshot is used; a preemption while pages are outstanding exits 76 and keeps the
snapshot.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from cairn.process import criu as criu_mod
from cairn.process import uffd
from cairn.process.images import PAGE_SIZE, PE_LAZY, read_pagemap
from cairn.runtime.exits import ExitCode
from cairn.store import Key
from cairn import open_store
from tests.support.cairn_run import COUNTER, CRIU, CairnRun, can_run_criu, \
    kill_after_commits, metric_steps, wait_for
from tests.support.tamper import flip_byte

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
    pytest.mark.skipif(CRIU is None or not criu_mod.has_feature(CRIU, "uffd-noncoop"),
                       reason="this kernel has no userfaultfd for CRIU"),
]

STEPS = 300
KEY = "dag/lazy/1"


def counter(tmp_path: Path, *, restore: str, env: dict[str, str] | None = None) -> CairnRun:
    work = tmp_path / "workspace"
    work.mkdir(exist_ok=True)
    return CairnRun(store=str(tmp_path / "store"), key=KEY,
                    command=[sys.executable, str(COUNTER), str(work / "metrics.txt"), str(STEPS),
                             "0.05"],
                    workdir=work / "cairn", logs=tmp_path / "logs", every="1s",
                    extra=["--restore", restore], cwd=tmp_path, env=env)


def interrupted_run(tmp_path: Path, snapshots: int) -> None:
    """A first run killed (supervisor and workload) after ``snapshots`` commits."""
    kill_after_commits(counter(tmp_path, restore="eager"), snapshots)


def test_a_lazy_restore_resumes_every_step_once(tmp_path: Path) -> None:
    interrupted_run(tmp_path, 2)
    second = counter(tmp_path, restore="lazy")
    assert second.wait(300) == 0, second.stderr
    assert "restored snapshot seq" in second.stderr, second.stderr
    assert "lazy restore complete: every page in" in second.stderr, second.stderr
    assert "restoring snapshot seq" not in second.stderr, "no fallback to eager"
    assert metric_steps(tmp_path / "workspace" / "metrics.txt") == list(range(STEPS))


def lazy_chunk_only_in(store_url: str, newest: int, previous: int) -> tuple[str, int]:
    """``(pack, offset)`` of a chunk of the newest snapshot's lazily restored pages that the
    previous snapshot does not share."""
    with open_store(store_url) as store:
        key = Key.parse(KEY)
        new, old = store.manifest(key, newest), store.manifest(key, previous)
        shared = {c.digest for c in old.chunk_refs()}
        reader = store.reader(new)
        for entry in new.files:
            name = entry.path.rsplit("/", 1)[-1]
            if not name.startswith("pagemap-"):
                continue
            local = Path(store_url) / ".." / f"{name}.copy"
            local.write_bytes(reader.read_file(entry.path))
            pages_id, runs = read_pagemap(local)
            pages = new.file(f"images/pages-{pages_id}.img")
            starts, position = [], 0
            for chunk in pages.chunks:
                starts.append((position, chunk))
                position += chunk.size
            offset = 0
            for run in runs:
                if not run.present:
                    continue
                end = offset + run.nr_pages * PAGE_SIZE
                if run.flags & PE_LAZY:
                    for start, chunk in starts:
                        if offset <= start < end and chunk.digest not in shared:
                            return chunk.pack, chunk.offset
                offset = end
    raise AssertionError("no lazily restored chunk is unique to the newest snapshot")


def test_a_lazy_page_that_fails_verification_falls_back_to_the_previous_snapshot(
        tmp_path: Path) -> None:
    interrupted_run(tmp_path, 3)
    store_url = str(tmp_path / "store")
    with open_store(store_url) as store:
        seqs = [info.seq for info in store.snapshots(Key.parse(KEY))]
        backend = store.backend
        newest, previous = seqs[0], seqs[1]
        pack, offset = lazy_chunk_only_in(store_url, newest, previous)
        flip_byte(backend, pack, offset)
    # This machine saw the newer one commit: going back is a rollback, allowed here (ADR 0049).
    second = counter(tmp_path, restore="lazy", env={"CAIRN_ALLOW_ROLLBACK": "1"})
    assert second.wait(300) == 0, second.stderr
    err = second.stderr
    assert f"the restore of snapshot seq {newest} failed while the workload ran" in err, err
    assert "does not match its digest" in err, err
    assert f"restored snapshot seq {previous} of key" in err, err
    assert metric_steps(tmp_path / "workspace" / "metrics.txt") == list(range(STEPS)), \
        "each step exactly once, the failed restore's lines cut back"
    leftovers = [root for root, _, _ in os.walk(tmp_path / "workspace" / "cairn")
                 if os.path.basename(root).startswith("restore-")]
    assert leftovers == [], "a failed restore's scratch is removed"


MEMORY_CHILD = Path(__file__).with_name("lazy_memory_child.py")
MEMORY_STEPS = 150
MEMORY_MIB = 128


def memory_run(tmp_path: Path, *, restore: str) -> CairnRun:
    work = tmp_path / "workspace"
    work.mkdir(exist_ok=True)
    return CairnRun(store=str(tmp_path / "store"), key=KEY,
                    command=[sys.executable, str(MEMORY_CHILD), str(work / "metrics.txt"),
                             str(work / "report.txt"), str(MEMORY_STEPS), "0.05",
                             str(MEMORY_MIB)],
                    workdir=work / "cairn", logs=tmp_path / "logs", every="1s",
                    extra=["--restore", restore], cwd=tmp_path)


def interrupted_memory_run(tmp_path: Path, snapshots: int) -> None:
    kill_after_commits(memory_run(tmp_path, restore="eager"), snapshots, timeout=300)


def test_a_lazy_restore_puts_back_every_page_through_fork_madvise_and_mremap(
        tmp_path: Path) -> None:
    interrupted_memory_run(tmp_path, 2)
    second = memory_run(tmp_path, restore="lazy")
    assert second.wait(300) == 0, second.stderr
    assert "lazy restore complete: every page in" in second.stderr, second.stderr
    report = (tmp_path / "workspace" / "report.txt").read_text()
    assert "WRONG" not in report, report
    # The restored workload saw its memory arrive (mincore), forked, released and moved
    # memory meanwhile, and found every page of 128 MiB as it was dumped at the end.
    assert "lazy phase: fork, madvise and mremap checked" in report, report
    assert report.rstrip().endswith("every page verified"), report
    assert metric_steps(tmp_path / "workspace" / "metrics.txt") == list(range(MEMORY_STEPS))


def lazy_socket_present(work: Path) -> bool:
    """Whether a lazy restore's handler is listening (it does so before CRIU restores)."""
    for root in (work, Path("/dev/shm")):
        for _ in root.glob(f"**/restore-*/images/{uffd.SOCKET_NAME}"):
            return True
    return False


def test_a_preemption_while_pages_are_outstanding_keeps_the_restored_snapshot(
        tmp_path: Path) -> None:
    interrupted_memory_run(tmp_path, 2)
    with open_store(str(tmp_path / "store")) as store:
        before = [info.seq for info in store.snapshots(Key.parse(KEY))]
    second = memory_run(tmp_path, restore="lazy")
    # The notice arrives while CRIU restores: the supervisor reads it once the tree runs,
    # with 128 MiB still to copy in, so no dump may be taken.
    wait_for(lambda: lazy_socket_present(tmp_path) or second.proc.poll() is not None, 120,
             "the lazy restore to start")
    second.signal(signal.SIGTERM)
    assert second.wait(300) == ExitCode.PREEMPTED_KEPT, second.stderr
    assert "is still filling the workload's memory" in second.stderr, second.stderr
    with open_store(str(tmp_path / "store")) as store:
        assert [info.seq for info in store.snapshots(Key.parse(KEY))] == before, \
            "no snapshot of a half-filled process"
    third = memory_run(tmp_path, restore="eager")
    assert third.wait(300) == 0, third.stderr
    assert f"restored snapshot seq {before[0]} of key" in third.stderr, third.stderr
    report = (tmp_path / "workspace" / "report.txt").read_text()
    assert "WRONG" not in report and report.rstrip().endswith("every page verified"), report
    assert metric_steps(tmp_path / "workspace" / "metrics.txt") == list(range(MEMORY_STEPS))
