"""Process snapshots in the store: CRIU images plus the files the workload appends to.

Layout of one snapshot (``SnapshotMode.PROCESS``):

* ``images/<name>``: every file CRIU wrote, page images cut at the start of every memory
  region (pagemap entry) so that a region's chunks stay identical from one dump to the next
  when other regions grow, shrink or move, and dedup against the parent finds them;
* ``files/<n>``: the n-th regular file the workload held open in append mode (its stdout and
  stderr logs among them), up to its size at the dump.

``metadata.compat`` holds the compatibility record; ``metadata.user.process`` the tracked
files (path and dumped size), the PIDs and CRIU's dump statistics.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import CorruptSnapshot
from cairn.process import criu as criu_mod
from cairn.process.images import RegFile, pages_cuts_by_file, read_dump_stats, read_reg_files
from cairn.store import Manifest, SnapshotMode, Store

IMAGES = "images"
FILES = "files"


@dataclass(frozen=True)
class TrackedFile:
    """A file the workload appends to, and its size at the dump."""

    path: str
    size: int


@dataclass(frozen=True)
class IngestReport:
    manifest: Manifest
    frozen_us: int
    image_bytes: int
    bytes_written: int
    tracked: tuple[TrackedFile, ...] = field(default_factory=tuple)


def tracked_sizes(reg_files: list[RegFile], paths: list[str]) -> list[TrackedFile]:
    """The dumped size of each of ``paths`` from CRIU's own record of the open files.

    For a file in append mode CRIU keeps the position, which is its end after the last write
    (CRIU records an explicit size only for files written in place)."""
    by_name: dict[str, int] = {}
    for reg in reg_files:
        size = reg.size if reg.size is not None else reg.pos
        by_name[reg.name] = max(size, by_name.get(reg.name, 0))
    return [TrackedFile(p, by_name[p]) for p in paths if p in by_name]


def directory_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def ingest(attempt: Any, image_dir: str, *, tracked_paths: list[str],
           compat: Mapping[str, Any], info: Mapping[str, Any]) -> IngestReport:
    """Commit the dump in ``image_dir`` plus the tracked files as the attempt's next snapshot.

    Durable when it returns. A tracked file is read up to its dumped size even if it grew
    since (the workload may be running again)."""
    tracked = tracked_sizes(read_reg_files(image_dir), tracked_paths)
    return commit_dump(attempt, image_dir, tracked=tracked,
                       sources=[t.path for t in tracked], compat=compat, info=info)


def commit_dump(attempt: Any, image_dir: str, *, tracked: Sequence[TrackedFile],
                sources: Sequence[str], compat: Mapping[str, Any], info: Mapping[str, Any],
                before_commit: Callable[[], None] | None = None) -> IngestReport:
    """Commit the dump in ``image_dir`` as the attempt's next snapshot, each tracked file read
    from the matching entry of ``sources`` (its live path, or a copy in a spool entry) up to
    its dumped size; the manifest records the tracked files' original paths.

    ``before_commit`` runs after every pack is written and before the ``snap`` record is
    created; raising from it aborts the snapshot (nothing becomes visible)."""
    if len(sources) != len(tracked):
        raise ValueError("give one source per tracked file")
    stats = read_dump_stats(image_dir)
    cuts = pages_cuts_by_file(image_dir)
    image_bytes = 0
    with attempt.snapshot(mode=SnapshotMode.PROCESS) as snap:
        for name in sorted(os.listdir(image_dir)):
            path = os.path.join(image_dir, name)
            if name == criu_mod.DUMP_LOG or not os.path.isfile(path):
                continue
            image_bytes += os.path.getsize(path)
            snap.add_file(f"{IMAGES}/{name}", path, cuts=cuts.get(name, ()))
        for index, (item, source) in enumerate(zip(tracked, sources)):
            with open(source, "rb") as f:
                snap.add_stream(f"{FILES}/{index}", f, size=item.size)
        user = {"process": {**info, "tracked": [{"path": t.path, "size": t.size} for t in tracked],
                            "frozen_us": stats.frozen_us, "freezing_us": stats.freezing_us,
                            "memdump_us": stats.memdump_us, "memwrite_us": stats.memwrite_us,
                            "pages_written": stats.pages_written, "image_bytes": image_bytes}}
        if before_commit is not None:
            before_commit()
        manifest = snap.commit(compat=compat, user=user)
        written = snap.stats.bytes_written
    return IngestReport(manifest, stats.frozen_us, image_bytes, written, tuple(tracked))


def process_info(manifest: Manifest) -> dict[str, Any]:
    info = (manifest.metadata.get("user") or {}).get("process")
    if not isinstance(info, dict):
        raise CorruptSnapshot(f"seq {manifest.seq} has no process metadata", seq=manifest.seq)
    return info


def fetch(store: Store, manifest: Manifest, dest: str) -> list[TrackedFile]:
    """Restore the snapshot's files into ``dest`` (verified, all or nothing), then put every
    tracked file back at its path with exactly its dumped content: a log cut back to the
    dumped size, so the restored process does not write its lines a second time, or written
    afresh on a node that never had it. Returns the tracked files; images are in
    ``dest/images``. Raises CorruptSnapshot."""
    info = process_info(manifest)
    store.reader(manifest).restore_to(dest)
    tracked = [TrackedFile(str(t["path"]), int(t["size"])) for t in info.get("tracked", [])]
    for index, item in enumerate(tracked):
        source = os.path.join(dest, FILES, str(index))
        if not os.path.isfile(source) or os.path.getsize(source) != item.size:
            raise CorruptSnapshot(f"seq {manifest.seq}: tracked file {item.path} is missing from "
                                  "the snapshot", seq=manifest.seq)
        os.makedirs(os.path.dirname(item.path) or ".", exist_ok=True)
        # Rewrite in place (same inode where it exists): CRIU reopens it by path.
        with open(source, "rb") as src, open(item.path, "ab") as out:
            out.truncate(0)
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
    return tracked
