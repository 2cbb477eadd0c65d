"""Restoring a process snapshot: fetch its images, then CRIU, eagerly or lazily.

*Eager* (the default): every image is fetched and verified into a scratch directory (where
the staging policy puts the copy plus the restored process, :mod:`cairn.process.staging`),
then ``criu restore``
reads it and the scratch is removed. The fetch is one pipeline of verified ranged reads
written in place, with no fsync: the copy only lives until CRIU has read it.

*Lazy* (``--restore lazy``, ADR 0021): the small images and the pages CRIU restores itself
are fetched first, CRIU restores the tree with its private memory left to userfaultfd, and
the workload runs while :mod:`cairn.process.lazy` serves the rest from verified chunks. The
scratch then stays until every page is in (:meth:`Restored.finished`). Lazy falls back to
eager, with the reason logged, where it is unsafe: a snapshot holding GPU state (the driver's
checkpoint must be resumed against complete memory), or a CRIU or kernel without
userfaultfd.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cairn.exceptions import CriuFailed
from cairn.process import criu as criu_mod
from cairn.process import image_stream as stream_mod
from cairn.process import lazy as lazy_mod
from cairn.process import snapshot as snap_mod
from cairn.process import staging as staging_mod
from cairn.runtime.choices import coerce_option
from cairn.store import Manifest, Store

log = logging.getLogger("cairn.run")


class RestoreMode(str, enum.Enum):
    """How ``cairn run`` restores a snapshot (``--restore``, ``CAIRN_RESTORE``)."""

    EAGER = "eager"  # every page in place before the workload runs
    LAZY = "lazy"  # the workload runs while its private memory arrives (userfaultfd)

    @classmethod
    def parse(cls, value: object, *, source: str = "--restore") -> RestoreMode:
        """``value`` (a member or its text) as a member; ConfigError naming the choices."""
        return coerce_option(cls, value, source)  # type: ignore[no-any-return]


def scratch_choice(policy: staging_mod.StagingMedium, manifest: Manifest, *, memory_dir: str,
                   disk_dir: str) -> staging_mod.StagingChoice:
    """Where a restore of ``manifest`` puts its scratch copy: where the staging policy would
    put an image of the copy and the restored process together (twice the image)."""
    image = int(snap_mod.process_info(manifest).get("image_bytes") or 0)
    return staging_mod.choose_staging(policy, image_bytes=2 * image or None,
                                      memory_dir=memory_dir, disk_dir=disk_dir)


def lazy_unsafe(manifest: Manifest, *, uffd_ok: bool) -> str | None:
    """Why ``manifest`` must be restored eagerly, or None when lazy is safe."""
    info = snap_mod.process_info(manifest)
    if info.get("gpu_pids"):
        return "it holds GPU state, which is resumed against complete memory"
    if not lazy_mod.pages_names(manifest):
        return "it has no pages image"
    if not uffd_ok:
        return "this CRIU or kernel has no userfaultfd (criu check --feature uffd-noncoop)"
    return None


def stream_unsafe(manifest: Manifest) -> str | None:
    """Why an eager restore of ``manifest`` goes through a scratch copy of its pages rather
    than streaming them to CRIU, or None when streaming is fine."""
    info = snap_mod.process_info(manifest)
    if info.get("gpu_pids"):
        return "it holds GPU state (the checkpoint plugin's path reads image files)"
    if not lazy_mod.pages_names(manifest):
        return "it has no pages image"
    return None


def _reap_failed_root(manifest: Manifest, *, wait_s: float = 10.0) -> None:
    """Reap the root of a tree CRIU killed when its restore failed: restored as this
    process's child (``--restore-sibling``), it would otherwise stay a zombie holding the
    PID the previous snapshot needs."""
    root = snap_mod.process_info(manifest).get("root_pid")
    if not isinstance(root, int) or root <= 0:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reaped, _ = os.waitpid(root, os.WNOHANG)
        except ChildProcessError:
            return  # not ours, or never created
        if reaped or time.monotonic() > deadline:
            return
        time.sleep(0.02)


@dataclass
class Restored:
    """A restored tree: its root's PID, the tracked files as put back, and, for a lazy
    restore, what is still arriving. Owned by the thread that restored it."""

    pid: int
    tracked: list[snap_mod.TrackedFile]
    mode: RestoreMode
    scratch: str
    fetch_s: float
    criu_s: float
    lazy: lazy_mod.LazyRestore | None = None
    streamed: bool = False  # eager, its pages read by CRIU from verified chunks (no copy)

    @property
    def how(self) -> str:
        """How the tree came back, for the log: ``lazy``, ``eager, pages streamed`` or
        ``eager, through a scratch copy``."""
        if self.mode is RestoreMode.LAZY:
            return "lazy"
        return "eager, pages streamed" if self.streamed else "eager, through a scratch copy"

    @property
    def finished(self) -> bool:
        """Every page is in (always, for an eager restore) or the lazy restore failed; the
        scratch is removed once this is True."""
        if self.lazy is None:
            return True
        if not self.lazy.poll():
            return False
        self.close()
        return True

    def close(self) -> None:
        """Stop whatever still serves pages and remove the scratch (idempotent)."""
        if self.lazy is not None:
            self.lazy.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def restore(store: Store, manifest: Manifest, *, criu: str, scratch: str, pidfile: str,
            roots: Sequence[str], mode: RestoreMode,
            prepare: Callable[[str], Callable[[], None]],
            kill_tree: Callable[[int], None], uffd_ok: bool = True,
            timeout: float | None = None, stream: bool = True) -> Restored:
    """Fetch ``manifest`` into ``scratch`` (a new directory) and restore it with CRIU.

    ``prepare(image_dir)`` runs once the images are in, before CRIU (socket directories,
    shared-memory files), and returns what undoes it should CRIU fail. ``kill_tree(root)`` kills
    the restored tree (a lazy restore calls it when a chunk fails verification, before the
    tree could read a page it did not get). Raises CorruptSnapshot (the scratch is removed),
    CriuFailed, or whatever else failed on this side (the failure a streamed image or a lazy
    page met, as recorded: a RestoreFailed, rather than CRIU's error); on success the caller
    owns the returned :class:`Restored` and must :meth:`~Restored.close` it, or poll
    :attr:`~Restored.finished`."""
    if mode is RestoreMode.LAZY:
        reason = lazy_unsafe(manifest, uffd_ok=uffd_ok)
        if reason is not None:
            log.warning("restoring snapshot seq %d eagerly: %s", manifest.seq, reason)
            mode = RestoreMode.EAGER
    if mode is RestoreMode.EAGER and stream:
        reason = stream_unsafe(manifest)
        if reason is not None:
            log.info("restoring snapshot seq %d through a scratch copy: %s", manifest.seq, reason)
            stream = False
    streaming = mode is RestoreMode.EAGER and stream
    started = time.monotonic()
    # Left out of the scratch copy: the pages a lazy restore serves, or those streamed to CRIU.
    held_back = lazy_mod.pages_names(manifest) if mode is RestoreMode.LAZY or streaming else []
    image_dir = os.path.join(scratch, snap_mod.IMAGES)
    lazy: lazy_mod.LazyRestore | None = None
    streamer: stream_mod.ImageStreamer | None = None
    try:
        tracked = snap_mod.fetch(store, manifest, scratch, roots=roots, lazy_images=held_back)
        if mode is RestoreMode.LAZY:
            lazy = lazy_mod.LazyRestore(store=store, manifest=manifest, image_dir=image_dir,
                                        pages_names=held_back, kill_tree=kill_tree)
        fetched = time.monotonic()
        undo = prepare(image_dir)
        try:
            if lazy is not None:
                try:
                    pid = lazy.start(criu, pidfile=pidfile, timeout=timeout)
                except BaseException:
                    _reap_failed_root(manifest)  # its PID must be free for the next restore
                    raise
            elif streaming:
                streamer = stream_mod.ImageStreamer(
                    store=store, manifest=manifest, image_dir=image_dir, streamed=held_back,
                    images_prefix=f"{snap_mod.IMAGES}/")
                streamer.start()
                try:
                    pid = criu_mod.restore(criu, streamer.criu_dir, pidfile=pidfile,
                                           timeout=timeout, extra=["--stream"])
                except CriuFailed:
                    _reap_failed_root(manifest)
                    failure = streamer.failure  # why CRIU read a short image, if it was us
                    if failure is not None:
                        raise failure from failure.__cause__
                    raise
                finally:
                    streamer.close()
            else:
                pid = criu_mod.restore(criu, image_dir, pidfile=pidfile, timeout=timeout)
        except BaseException:
            undo()
            raise
    except BaseException:
        if lazy is not None:
            lazy.close()
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    done = time.monotonic()
    restored = Restored(pid=pid, tracked=tracked, mode=mode, scratch=scratch,
                        fetch_s=fetched - started, criu_s=done - fetched, lazy=lazy,
                        streamed=streaming)
    if lazy is None:
        restored.close()  # CRIU has read every image
    log.info("restored seq %d %s%s: fetch %.2fs, criu %.2fs", manifest.seq, mode.value,
             " (pages streamed to criu)" if streaming else "", restored.fetch_s,
             restored.criu_s)
    return restored
