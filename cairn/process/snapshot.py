"""Process snapshots in the store: CRIU images plus the files the workload appends to.

Layout of one snapshot (``SnapshotMode.PROCESS``):

* ``images/<name>``: every file CRIU wrote, page images cut at the start of every memory
  region (pagemap entry) so that a region's chunks stay identical from one dump to the next
  when other regions grow, shrink or move, and dedup against the parent finds them;
* ``files/<n>``: the n-th regular file the workload held open in append mode (its stdout and
  stderr logs among them), up to its size at the dump.

``metadata.compat`` holds the compatibility record; ``metadata.user.process`` the tracked
files (path and dumped size), the PIDs and CRIU's dump statistics.

Tracked files live only under the *track roots* (:func:`track_roots`): the working directory,
cairn's log directory and the directories in ``CAIRN_TRACK_ROOTS``. A dump of a workload
appending to a file elsewhere is refused with that fix named; a restore takes the roots from
its own side, never from the manifest, and writes each tracked file through
:func:`cairn.store.confined.open_beneath` (no symlink at any component, no device, no file
with other hard links), so a manifest crafted by whoever can write the bucket cannot make a
restore running as root write anywhere else (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import CorruptSnapshot, NotSnapshottable, UnsafePath
from cairn.process import criu as criu_mod
from cairn.process.images import RegFile, pages_layout_by_file, read_dump_stats, read_reg_files
from cairn.store import Manifest, SnapshotMode, Store
from cairn.store.confined import normalize_roots, open_beneath, split_under
from cairn.runtime.env import TRACK_ROOTS

IMAGES = "images"
FILES = "files"
# Extra directories tracked files may live under, separated by os.pathsep (":"); also set by
# the integrations.
TRACK_ROOTS_ENV = TRACK_ROOTS.name

log = logging.getLogger("cairn.run")


def track_roots(*, log_dir: str | None, cwd: str | None = None,
                environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The directories tracked files may live under, as this side configures them: ``cwd``
    (the current directory when None), ``log_dir`` (cairn's run directory, which holds the
    workload's stdout and stderr) and every entry of ``CAIRN_TRACK_ROOTS`` in ``environ``
    (``os.environ`` when None). Resolved, longest first. Raises UnsafePath for a root of '/'."""
    env = os.environ if environ is None else environ
    extra = [p for p in env.get(TRACK_ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    for p in extra:
        if not os.path.isabs(p):
            raise UnsafePath(f"{TRACK_ROOTS_ENV} entry {p!r} is not an absolute path; give "
                             f"absolute directories separated by {os.pathsep!r}")
    return normalize_roots([os.getcwd() if cwd is None else cwd, log_dir or "", *extra])


def check_tracked(paths: Sequence[str], *, roots: Sequence[str]) -> None:
    """Refuse, before anything is written, tracked files a restore would refuse: each of
    ``paths`` must lie under one of ``roots`` (see :func:`track_roots`). Raises
    NotSnapshottable naming every file outside and the fix."""
    roots = normalize_roots(roots)
    outside = []
    for path in paths:
        try:
            split_under(path, roots)
        except UnsafePath:
            outside.append(path)
    if outside:
        dirs = sorted({os.path.dirname(p) for p in outside})
        raise NotSnapshottable(
            "cannot snapshot the workload: it appends to "
            f"{', '.join(outside)}, outside the track roots ({', '.join(roots)}), and a restore "
            f"writes only under those; set {TRACK_ROOTS_ENV}={os.pathsep.join(dirs)} (absolute "
            f"directories separated by {os.pathsep!r}) where the step runs, or write the file "
            "under the working directory")


def _run_dir_of(staging_path: str) -> str:
    """The run directory of a supervisor's ``<run dir>/staging/<name>`` (until the supervisor
    passes its roots explicitly)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(staging_path)))


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


def tracked_sizes(reg_files: list[RegFile], paths: list[str], *,
                  roots: Sequence[str] | None = None) -> list[TrackedFile]:
    """The dumped size of each of ``paths`` from CRIU's own record of the open files.

    For a file in append mode CRIU keeps the position, which is its end after the last write
    (CRIU records an explicit size only for files written in place). With ``roots``, raises
    NotSnapshottable for a path outside them (see :func:`check_tracked`)."""
    if roots is not None:
        check_tracked(paths, roots=roots)
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
           compat: Mapping[str, Any], info: Mapping[str, Any],
           roots: Sequence[str] | None = None, last: bool = False) -> IngestReport:
    """Commit the dump in ``image_dir`` plus the tracked files as the attempt's next snapshot.

    Durable when it returns. A tracked file is read up to its dumped size even if it grew
    since (the workload may be running again). Every tracked file must lie under ``roots``
    (default: :func:`track_roots` with the run directory holding ``image_dir``), else
    NotSnapshottable names the fix and nothing is committed. ``last``: the try's final
    snapshot (no page hashes for a next one: :class:`~cairn.store.writer.SnapshotWriter`)."""
    if roots is None:
        roots = track_roots(log_dir=_run_dir_of(image_dir))
    tracked = tracked_sizes(read_reg_files(image_dir), tracked_paths, roots=roots)
    return commit_dump(attempt, image_dir, tracked=tracked,
                       sources=[t.path for t in tracked], compat=compat, info=info, last=last)


def commit_dump(attempt: Any, image_dir: str, *, tracked: Sequence[TrackedFile],
                sources: Sequence[str], compat: Mapping[str, Any], info: Mapping[str, Any],
                before_commit: Callable[[], None] | None = None,
                last: bool = False) -> IngestReport:
    """Commit the dump in ``image_dir`` as the attempt's next snapshot, each tracked file read
    from the matching entry of ``sources`` (its live path, or a copy in a spool entry) up to
    its dumped size; the manifest records the tracked files' original paths.

    ``before_commit`` runs after every pack is written and before the ``snap`` record is
    created; raising from it aborts the snapshot (nothing becomes visible)."""
    if len(sources) != len(tracked):
        raise ValueError("give one source per tracked file")
    started = time.monotonic()
    stats = read_dump_stats(image_dir)
    layout = pages_layout_by_file(image_dir)
    image_bytes = 0
    with attempt.snapshot(mode=SnapshotMode.PROCESS, last=last) as snap:
        for name in sorted(os.listdir(image_dir)):
            path = os.path.join(image_dir, name)
            if name == criu_mod.DUMP_LOG or not os.path.isfile(path):
                continue
            image_bytes += os.path.getsize(path)
            cuts, addresses = layout.get(name, ([], None))
            # Page chunks are located by virtual address, so a chunk that changed in a few
            # pages is stored as a delta of the last dump's chunk at the same address.
            snap.add_file(f"{IMAGES}/{name}", path, cuts=cuts, locators=addresses)
        for index, (item, source) in enumerate(zip(tracked, sources)):
            with open(source, "rb") as f:
                snap.add_stream(f"{FILES}/{index}", f, size=item.size)
        user = {"process": {**info, "tracked": [{"path": t.path, "size": t.size} for t in tracked],
                            "frozen_us": stats.frozen_us, "freezing_us": stats.freezing_us,
                            "memdump_us": stats.memdump_us, "memwrite_us": stats.memwrite_us,
                            "pages_written": stats.pages_written, "image_bytes": image_bytes,
                            # what a later try's final-snapshot budget goes by (dump_s is
                            # in info, from the dumper)
                            "ingest_s": round(time.monotonic() - started, 3)}}
        if before_commit is not None:
            before_commit()
        manifest = snap.commit(compat=compat, user=user)
        written = snap.stats.bytes_written
    return IngestReport(manifest, stats.frozen_us, image_bytes, written, tuple(tracked))


def snapshot_rate(manifest: Manifest) -> float | None:
    """The image bytes per second its dump and ingest took when ``manifest`` was taken
    (recorded by cairn since 2026-12-07; None when not recorded or not plausible)."""
    info = (manifest.metadata.get("user") or {}).get("process")
    if not isinstance(info, dict):
        return None
    try:
        seconds = float(info["dump_s"]) + float(info["ingest_s"])
        image = int(info["image_bytes"])
    except (KeyError, TypeError, ValueError):
        return None
    return image / seconds if seconds > 0 and image > 0 else None


def process_info(manifest: Manifest) -> dict[str, Any]:
    info = (manifest.metadata.get("user") or {}).get("process")
    if not isinstance(info, dict):
        raise CorruptSnapshot(f"seq {manifest.seq} has no process metadata", seq=manifest.seq)
    return info


def fetch(store: Store, manifest: Manifest, dest: str, *,
          roots: Sequence[str] | None = None,
          lazy_images: Sequence[str] = ()) -> list[TrackedFile]:
    """Restore the snapshot's files into ``dest`` (verified, all or nothing), then put every
    tracked file back at its path with exactly its dumped content: a log cut back to the
    dumped size, so the restored process does not write its lines a second time, or written
    afresh on a node that never had it. Returns the tracked files; images are in
    ``dest/images``.

    Tracked files are written only under ``roots`` (default: :func:`track_roots` with the run
    directory holding ``dest``), never through a symlink, onto a device or onto a file with
    other hard links; modes and owners of existing files are left as they are. Every path is
    checked before anything is downloaded and every target opened before any is rewritten.
    Raises UnsafePath (a CorruptSnapshot: the snapshot is not trusted) naming the path and
    the reason, or CorruptSnapshot.

    The copy in ``dest`` is a scratch copy, deleted once CRIU read it: it is not fsynced.
    Images named in ``lazy_images`` (pages images, for a lazy restore) are left out; the
    caller fetches them (:mod:`cairn.process.lazy`)."""
    info = process_info(manifest)
    if roots is None:
        roots = track_roots(log_dir=_run_dir_of(dest))
    roots = normalize_roots(roots)
    try:
        tracked = [TrackedFile(str(t["path"]), int(t["size"])) for t in info.get("tracked", [])]
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptSnapshot(f"seq {manifest.seq}: malformed tracked files ({e!r})",
                              seq=manifest.seq) from None
    places = []
    for item in tracked:
        try:
            places.append(split_under(item.path, roots))
        except UnsafePath as e:
            log.error("refusing snapshot seq %d: tracked file refused: %s", manifest.seq, e)
            raise UnsafePath(f"seq {manifest.seq}: tracked file refused: {e}",
                             seq=manifest.seq) from None
    store.reader(manifest).restore_to(dest, durable=False,
                                      exclude=[f"{IMAGES}/{name}" for name in lazy_images])
    for index, item in enumerate(tracked):
        source = os.path.join(dest, FILES, str(index))
        if not os.path.isfile(source) or os.path.getsize(source) != item.size:
            raise CorruptSnapshot(f"seq {manifest.seq}: tracked file {item.path} is missing from "
                                  "the snapshot", seq=manifest.seq)
    fds: list[int] = []
    try:
        for root, name in places:
            os.makedirs(root, exist_ok=True)  # a root is this side's own configuration
            try:
                # Rewrite in place (same inode where it exists): CRIU reopens it by path.
                fds.append(open_beneath(root, name, flags=os.O_WRONLY | os.O_CREAT,
                                        mode=0o644))
            except UnsafePath as e:
                log.error("refusing snapshot seq %d: %s", manifest.seq, e)
                raise UnsafePath(f"seq {manifest.seq}: {e}", seq=manifest.seq) from None
        for index, fd in enumerate(fds):
            with open(os.path.join(dest, FILES, str(index)), "rb") as src:
                os.ftruncate(fd, 0)
                with os.fdopen(os.dup(fd), "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                    out.flush()
                    os.fsync(out.fileno())
    finally:
        for fd in fds:
            os.close(fd)
    return tracked
