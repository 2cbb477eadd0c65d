"""``cairn run``'s start: choose the newest committed snapshot whose compatibility record fits
this host and workload and restore it (:mod:`cairn.process.restore`, eager or lazy), or start
the command fresh, saying which and why.

Only a store verdict (CorruptSnapshot) skips a snapshot; CRIU's or the host's failure starts
fresh; a failure of the reading on this side raises RestoreFailed and skips nothing (ADR 0037).
A lazy restore is followed until every page is in: no snapshot is taken of a half-filled
process, and one that fails verification while the workload runs is killed and the previous
snapshot tried. :class:`Restorer` is driven by the supervisor's (main) thread; a lazy
restore's threads only kill the tree they fill.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable

from cairn.exceptions import CorruptSnapshot, CriuFailed, ProcessError, RestoreFailed
from cairn.process import compat as compat_mod
from cairn.process import criu as criu_mod
from cairn.process import cuda as cuda_mod
from cairn.process import pids as pids_mod
from cairn.process import restore as restore_mod
from cairn.process import snapshot as snap_mod
from cairn.process import torch_shm, workload
from cairn.process.child import PID_WAIT_S, Child, kill_tree, wait_for_pids
from cairn.process.images import read_unix_socket_paths
from cairn.process.run_context import RunContext
from cairn.runtime import rollback
from cairn.store import Manifest, SnapshotMode
from cairn.store.verdicts import as_read_failure, reading

log = logging.getLogger("cairn.run")

SOCKET_DIR_PARENTS = ("/tmp", "/var/tmp", "/dev/shm")  # where a restore may make a socket's dir


class Restorer:
    """How one run's workload starts (module docstring). ``restored_from``: the snapshot it
    was restored from (None: fresh); ``restored``: the restore in progress, a lazy one until
    every page is in."""

    def __init__(self, ctx: RunContext, child: Child) -> None:
        self.ctx = ctx
        self.child = child
        self.restored_from: int | None = None
        # What the restored snapshot cost when it was taken (image bytes per second of dump
        # and ingest, from its metadata), for a final snapshot before this try measured one.
        self.restored_rate: float | None = None
        self.restored: restore_mod.Restored | None = None
        self.failed_seqs: set[int] = set()  # lazy restores that failed verification
        # Whether CRIU can serve pages lazily here: probed while the store opens when the
        # settings want lazy restores (:meth:`probe_lazy`), else asked when a restore asks.
        self.uffd_ok: Callable[[], bool] = lambda: criu_mod.has_feature(
            self.ctx.criu or "criu", "uffd-noncoop")

    def probe_lazy(self) -> None:
        """Start asking CRIU whether it can restore lazily here (the answer is awaited when a
        restore needs it)."""
        assert self.ctx.criu is not None
        self.uffd_ok = criu_mod.probe_feature(self.ctx.criu, "uffd-noncoop")

    def close(self) -> None:
        if self.restored is not None:
            self.restored.close()

    def start(self) -> dict[str, int]:
        """Restore or start the workload; returns the log offsets already shown. Only a store
        verdict (CorruptSnapshot) skips a snapshot; CRIU's or the host's failure (CriuFailed,
        OSError) starts fresh; any other failure raises RestoreFailed, skipping nothing."""
        assert self.ctx.store is not None
        reason = None
        snapshots = [i for i in self.ctx.store.snapshots(self.ctx.key)
                     if i.manifest.mode is SnapshotMode.PROCESS
                     and i.seq not in self.ctx.settings.exclude_seqs
                     and i.seq not in self.failed_seqs]
        for info in snapshots:
            manifest = info.manifest
            if self.ctx.mark is not None:
                rollback.refuse_older(self.ctx.key, info.seq, self.ctx.rollback_floor,
                                      self.ctx.mark, flag=rollback.ROLLBACK_FLAG)
            differences = compat_mod.differences(manifest.metadata.get("compat") or {},
                                                 self.ctx.compat, gpu_map=self.ctx.gpu_map())
            if differences:
                reason = (f"snapshot seq {manifest.seq} does not fit: " + "; ".join(differences))
                break
            try:
                with reading(manifest.seq):  # a RestoreFailed ends the try: nothing skipped
                    tracked = self._restore(manifest)
                assert self.restored is not None  # set by _restore
                log.warning("restored snapshot seq %d of key %s (pid %d), %s", manifest.seq,
                            self.ctx.key, self.child.pid, self.restored.how)
                self.restored_from = manifest.seq
                self.restored_rate = snap_mod.snapshot_rate(manifest)
                # Echo from the dumped sizes: the restored workload is already writing.
                return {t.path: t.size for t in tracked
                        if t.path in (self.ctx.stdout_path, self.ctx.stderr_path)}
            except CorruptSnapshot as e:
                log.warning("skipping snapshot seq %d: %s", manifest.seq, e)
                reason = f"no snapshot verifies (last tried seq {manifest.seq}: {e})"
            except (CriuFailed, OSError) as e:
                reason = f"restoring seq {manifest.seq} failed: {e}"
                log.error("%s", reason)
                break
        if not snapshots:
            reason = f"key {self.ctx.key} has no process snapshot"
        elif self.ctx.mark is not None and (reason or "").startswith("no snapshot verifies"):
            rollback.refuse_older(self.ctx.key, None, self.ctx.rollback_floor, self.ctx.mark,
                                  flag=rollback.ROLLBACK_FLAG)
        log.warning("starting fresh: %s", reason)
        s = self.ctx.settings
        self.child.spawn(s.argv, stdout_path=self.ctx.stdout_path,
                         stderr_path=self.ctx.stderr_path,
                         ignores_sigterm=s.workload_ignores_sigterm)
        return {}

    def _restore(self, manifest: Manifest) -> list[snap_mod.TrackedFile]:
        """Fetch and restore ``manifest`` (:mod:`cairn.process.restore`); returns the tracked
        files as put back. A lazy restore is left in ``self.restored`` until every page is
        in."""
        assert self.ctx.store is not None and self.ctx.criu is not None
        wait_for_pids([int(p) for p in snap_mod.process_info(manifest).get("pids", [])])
        os.makedirs(self.ctx.staging, exist_ok=True)  # the pid file's directory
        pidfile = os.path.join(self.ctx.staging, "restored.pid")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pidfile)  # an earlier restore's (CRIU refuses to overwrite it)
        scratch = os.path.join(self._restore_parent(manifest), f"restore-{manifest.seq}")
        shutil.rmtree(scratch, ignore_errors=True)
        mode = self.ctx.settings.restore
        restored = restore_mod.restore(
            self.ctx.store, manifest, criu=self.ctx.criu, scratch=scratch,
            pidfile=pidfile, roots=self.ctx.track_roots,
            mode=mode, prepare=self._prepare_restore, kill_tree=kill_tree,
            uffd_ok=mode is not restore_mod.RestoreMode.LAZY or self.uffd_ok())
        self.child.adopt(restored.pid)
        self.restored = restored
        tracked = restored.tracked
        gpu = [int(p) for p in snap_mod.process_info(manifest).get("gpu_pids", [])]
        if gpu:
            api = self.ctx.cuda_api()
            if api is None:
                raise CriuFailed("the snapshot holds GPU state and libcuda cannot be loaded here")
            plan = compat_mod.gpu_plan(manifest.metadata.get("compat") or {}, self.ctx.compat,
                                       gpu_map=self.ctx.gpu_map())
            if plan.pairs:
                log.warning("restoring the GPU state onto other GPUs: %s",
                            ", ".join(f"{o} -> {n}" for o, n in plan.pairs))
            try:
                cuda_mod.resume_restored(api, gpu, pairs=plan.pairs)
            except ProcessError as e:
                # CRIU put the tree back, the driver did not: it cannot run. Kill it.
                kill_tree(self.child.pid)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.child.pid, 0)
                raise CriuFailed(f"the GPU state did not come back: {e}") from e
        self.ctx.attempt.resume_from(manifest)
        self.ctx.runtime_base = float(snap_mod.process_info(manifest).get("runtime_s") or 0.0)
        tree = workload.process_tree(self.child.pid)
        try:
            pids_mod.advance_past(tree)
        except OSError as e:
            log.warning("cannot move ns_last_pid past the restored PIDs (%s); the workload's "
                        "new children may get low PIDs", e)
        return tracked

    def _restore_parent(self, manifest: Manifest) -> str:
        """Where a restore's scratch copy goes: where the staging policy
        (``RunSettings.staging``) would put an image of the copy and the restored process
        together."""
        self.ctx.sweep_memory_staging()
        choice = restore_mod.scratch_choice(self.ctx.settings.staging, manifest,
                                            memory_dir=self.ctx.memory_staging,
                                            disk_dir=self.ctx.staging)
        choice = self.ctx.usable(choice, strict=False, instead="restoring through the disk instead")
        log.info("restore scratch at %s (%s; the copy and the restored process)", choice.parent,
                 choice.reason)
        return choice.parent

    def _prepare_restore(self, image_dir: str) -> Callable[[], None]:
        """What a restore needs besides its images; returns what undoes it."""
        for socket_path in read_unix_socket_paths(image_dir):
            self.prepare_socket_dir(socket_path)
        shm_files = torch_shm.recreate(image_dir)
        return lambda: torch_shm.remove(shm_files)

    def pages_outstanding(self) -> bool:
        """Whether a lazy restore is still filling the workload's memory."""
        if self.restored is None:
            return False
        if self.restored.finished:
            lazy = self.restored.lazy
            if lazy is not None and lazy.failure is None:
                st = lazy.stats
                log.warning("lazy restore complete: every page in after %.2fs (running after "
                            "%.2fs); %.1f MB served in %d requests", st.resident_s or 0.0,
                            st.restored_s, st.bytes_served / 1e6, st.requests)
            if lazy is None or lazy.failure is None:
                self.restored = None
            return False
        return True

    def lazy_failed(self) -> bool:
        restored = self.restored
        if restored is None or restored.lazy is None:
            return False
        restored.lazy.poll()  # a handler that stopped early sets the failure (and kills the tree)
        return restored.lazy.failure is not None

    def restart_after_lazy_failure(self) -> dict[str, int]:
        """A lazy restore failed (a chunk did not verify, or its handler failed): its tree is
        killed; reap it and start again from the previous snapshot (or fresh). A failure of
        the reading on this side raises RestoreFailed instead: no snapshot is skipped."""
        assert self.restored is not None and self.restored.lazy is not None
        seq, failure = self.restored_from, self.restored.lazy.failure
        assert failure is not None  # lazy_failed() said so
        failure = as_read_failure(failure, seq=seq)
        log.error("the restore of snapshot seq %s failed while the workload ran: %s; it was "
                  "stopped, %s", seq, failure, "exiting" if isinstance(failure, RestoreFailed)
                  else "trying the previous snapshot")
        self.restored.close()
        self.restored = None
        if seq is not None:
            self.failed_seqs.add(seq)
        deadline = time.monotonic() + PID_WAIT_S
        while self.child.pid is not None and time.monotonic() < deadline:
            kill_tree(self.child.pid)
            if self.child.reap() is None:
                time.sleep(0.05)
        if isinstance(failure, RestoreFailed):
            raise failure
        self.restored_from = None
        return self.start()

    def prepare_socket_dir(self, socket_path: str) -> None:
        """Create the directory of a unix socket the images name, which CRIU needs to exist
        (multiprocessing's ``/tmp/pymp-*``, say). The images are not trusted: only one new
        directory, mode 0700, directly in a temporary directory or a track root, made without
        following a symlink (a symlinked parent raises OSError: the restore fails); anything
        else is left to CRIU to refuse."""
        directory = os.path.dirname(socket_path)
        parent, name = os.path.split(directory)
        if os.path.isdir(directory) and not os.path.islink(directory):
            return
        if (parent not in SOCKET_DIR_PARENTS and parent not in self.ctx.track_roots) \
                or name in ("", ".", "..") or os.path.normpath(directory) != directory:
            log.warning("not creating %s for a unix socket the snapshot names: only a new "
                        "directory directly in %s or a track root is made", directory,
                        ", ".join(SOCKET_DIR_PARENTS))
            return
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
        finally:
            os.close(fd)
