"""``cairn run``'s snapshots: check that the workload can be dumped, dump it with CRIU where
the staging policy says, and ingest the images into the store — or, with a spool (Kubernetes:
``cairn run --spool``), hand the dump to the sidecar's uploader, which commits it
(:mod:`cairn.process.spool`, ADR 0014), and account for its verdicts.

A snapshot freezes the workload only while CRIU writes its pages. :class:`Dumper` is driven by
the supervisor's (main) thread only.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping

from cairn.exceptions import CairnError, Fenced, NotSnapshottable
from cairn.process import compat as compat_mod
from cairn.process import criu as criu_mod
from cairn.process import cuda as cuda_mod
from cairn.process import gpu_budget
from cairn.process import gpu_refusals
from cairn.process import gpus as gpus_mod
from cairn.process import snapshot as snap_mod
from cairn.process import spool as spool_mod
from cairn.process import staging as staging_mod
from cairn.process import workload
from cairn.process.child import Child
from cairn.process.images import read_dump_stats
from cairn.process.run_context import RunContext
from cairn.process.spool_client import SpoolClient
from cairn.runtime.try_session import Saved

log = logging.getLogger("cairn.run")

DUMP_TIMEOUT_S = 900.0  # a CRIU dump that hangs this long is killed (the workload thaws)


def gpu_text(figures: Mapping[str, float]) -> str:
    """The GPU stall (lock -> unlock) for a snapshot's log line, beside CRIU's frozen time,
    with its lock and checkpoint (device-to-host copy) parts."""
    if not figures.get("gpu_stall_ms"):
        return ""
    return (f", GPU stalled {figures['gpu_stall_ms']:.0f} ms (lock to unlock; lock "
            f"{figures.get('gpu_lock_s', 0) * 1000:.0f} ms + checkpoint "
            f"{figures.get('gpu_checkpoint_s', 0) * 1000:.0f} ms)")


class Dumper:
    """The snapshots of one run's workload (module docstring). ``spool``: the sidecar's spool
    client when dumps are handed to an uploader (set once the run has prepared it)."""

    def __init__(self, ctx: RunContext, child: Child) -> None:
        self.ctx = ctx
        self.child = child
        self.spool: SpoolClient | None = None
        self._staging_medium: staging_mod.StagingMedium | None = None  # the last dump's

    def check_dumpable(self, tree: list[int]) -> tuple[list[str], list[int]]:
        """Refuse what CRIU could not restore. Returns the append-mode files to track and the
        processes holding CUDA state."""
        files = workload.open_files(tree)
        own = {self.ctx.stdout_path, self.ctx.stderr_path}
        problems = workload.rewritten_files(files) + workload.established_tcp(files)
        gpu: list[int] = []
        if workload.gpu_pids(tree):
            api = self.ctx.cuda_api()
            if api is None:
                problems.append(workload.Problem(
                    what="the workload maps an NVIDIA device but libcuda cannot be loaded here",
                    fix="run where the NVIDIA driver (>= 570) is installed, or use state mode "
                        "(cairn.Checkpointer)"))
            else:
                gpu = cuda_mod.cuda_pids(api, tree)
                if gpu:
                    inventory = gpus_mod.inventory()
                    self.ctx.gpu_use = inventory.use_of(tree)
                    problems += gpu_refusals.problems(tree, files, cuda_pids=gpu,
                                                      inventory=inventory, use=self.ctx.gpu_use)
                    if not problems:
                        cuda_mod.check_fits(self.ctx.gpu_use.total,
                                            device_wide=not self.ctx.gpu_use.matched)
        if not gpu:  # RDMA devices and NCCL's or CUDA's shared memory, whatever the driver says
            problems += gpu_refusals.problems(tree, files, cuda_pids=[])
        if problems:
            raise NotSnapshottable("cannot snapshot the workload:\n  " +
                                   "\n  ".join(str(p) for p in problems))
        tracked = sorted(own) + [p for p in workload.append_files(files) if p not in own]
        snap_mod.check_tracked(tracked, roots=self.ctx.track_roots)  # before, not after, the dump
        return tracked, gpu

    def dump_dir(self, tree: list[int], gpu: list[int]) -> str:
        """A new, empty directory for this dump's images, where the staging policy puts it
        (``RunSettings.staging``, checked per dump against the last image; before the first
        dump the workload's resident memory, plus the GPU memory the driver will copy into it,
        stands in; that copy also takes from the memory a staged image could have). Said at
        WARNING when the medium changes, else at INFO."""
        self.ctx.sweep_memory_staging()
        last = next((h["image_bytes"] for h in reversed(self.ctx.cost.history)
                     if h.get("entry") is None), None)
        estimate = None
        if last is None:
            estimate = workload.resident_bytes(tree) + (
                self.ctx.gpu_use.total if gpu and self.ctx.gpu_use else 0)
        headroom = None
        if gpu and self.ctx.gpu_use:  # the GPU copy lands in the same memory as a tmpfs image
            headroom = staging_mod.after_gpu_copy(
                staging_mod.memory_headroom(self.ctx.memory_staging), self.ctx.gpu_use.total)
        choice = staging_mod.choose_staging(self.ctx.settings.staging, image_bytes=last,
                                            estimate_bytes=estimate,
                                            memory_dir=self.ctx.memory_staging,
                                            disk_dir=self.ctx.staging, headroom=headroom)
        level = logging.INFO if choice.medium is self._staging_medium else logging.WARNING
        log.log(level, "staging the dump %s at %s (%s)",
                "in memory" if choice.medium is staging_mod.StagingMedium.MEMORY else "on disk",
                choice.parent, choice.reason)
        choice = self.ctx.usable(choice, strict=self.ctx.settings.staging is not
                              staging_mod.StagingMedium.AUTO, instead="staging on disk instead")
        self._staging_medium = choice.medium
        image_dir = os.path.join(choice.parent, f"dump-{int(time.time() * 1000)}")
        os.mkdir(image_dir, 0o700)
        return image_dir

    def snapshot(self, *, leave_running: bool, timeout: float = DUMP_TIMEOUT_S) -> Saved | None:
        """Dump, then ingest (or, with a spool, hand the dump to the uploader). Returns what
        was saved, or None when it failed (logged; the workload keeps running when
        ``leave_running``). A dump still running after ``timeout`` seconds is killed (a
        failure). Raises Fenced.

        Without a spool the dump stages where :meth:`dump_dir` puts it (memory or disk, per
        ``RunSettings.staging``) and is removed once ingested. With a spool it goes into the
        spool's entry, whatever the policy: the sidecar reads it from there, so the spool's
        volume is the medium (on Kubernetes the pod transform's ``emptyDir``, memory-backed and
        counted in the pod's memory by default)."""
        assert self.ctx.criu is not None and self.child.pid is not None
        started = time.monotonic()
        image_dir: str | None = None
        entry: str | None = None
        handed = False
        gpu_stall_s = gpu_checkpoint_s = gpu_lock_s = 0.0
        try:
            tree = workload.process_tree(self.child.pid)
            tracked, gpu = self.check_dumpable(tree)
            if gpu and leave_running and self.ctx.gpu_use is not None:
                gpu_budget.check_periodic(self.ctx.gpu_use.total, self.ctx.cost.history,
                                          grace_s=self.ctx.settings.grace_s)
            runtime = self.ctx.runtime_s()
            if self.spool is not None:
                entry = self.spool.spool.new_entry(self.ctx.attempt.epoch)
                image_dir = self.spool.spool.images_dir(entry)
            else:
                image_dir = self.dump_dir(tree, gpu)
            if gpu:
                api = self.ctx.cuda_api()
                assert api is not None
                # The lock waits at most a share of the time left (the final dump's budget).
                lock_ms = cuda_mod.lock_timeout_ms(started + timeout - time.monotonic())
                stall = cuda_mod.GpuStall()
                with cuda_mod.suspended(api, gpu, resume=leave_running, lock_timeout_ms=lock_ms,
                                        stall=stall):
                    criu_mod.dump(self.ctx.criu, self.child.pid, image_dir,
                                  leave_running=leave_running,
                                  ghost_limit=self.ctx.settings.ghost_limit,
                                  timeout=max(1.0, started + timeout - time.monotonic()))
                gpu_stall_s, gpu_checkpoint_s = stall.total_s, stall.checkpoint_s
                gpu_lock_s = stall.lock_s
            else:
                criu_mod.dump(self.ctx.criu, self.child.pid, image_dir, leave_running=leave_running,
                              ghost_limit=self.ctx.settings.ghost_limit, timeout=timeout)
            dumped = time.monotonic()
            staged = snap_mod.directory_bytes(image_dir)
            self.ctx.cost.peak_staging_bytes = max(self.ctx.cost.peak_staging_bytes, staged)
            compat = (compat_mod.with_gpu_use(self.ctx.compat, self.ctx.gpu_use.per_gpu)
                      if gpu and self.ctx.gpu_use else self.ctx.compat)
            gpu_figures = {"gpu_stall_ms": round(gpu_stall_s * 1000, 1),
                           "gpu_checkpoint_s": round(gpu_checkpoint_s, 4),
                           "gpu_lock_s": round(gpu_lock_s, 4),
                           "gpu_bytes": self.ctx.gpu_use.total if gpu and self.ctx.gpu_use else 0}
            info = {"root_pid": self.child.pid, "pids": tree, "gpu_pids": gpu,
                    "leave_running": leave_running, "runtime_s": round(runtime, 3),
                    "dump_s": round(dumped - started, 3)}
            if self.spool is not None and entry is not None:
                frozen_us = read_dump_stats(image_dir).frozen_us
                self.spool.spool.hand_off(
                    entry, key=self.ctx.key, store=self.ctx.store.url, epoch=self.ctx.attempt.epoch,
                    last_seq=self.ctx.attempt.log.last_seq, parent_seq=self.ctx.last_committed_seq(),
                    compat=compat, info=info, tracked_paths=tracked,
                    roots=self.ctx.track_roots)
                handed = True
                return self._spooled(entry, started, dumped, staged, frozen_us, gpu_figures)
            # A dump that ends the workload is the try's last snapshot.
            report = snap_mod.ingest(self.ctx.attempt, image_dir, tracked_paths=tracked,
                                     roots=self.ctx.track_roots, compat=compat, info=info,
                                     last=not leave_running)
        except Fenced:
            raise
        except (CairnError, OSError) as e:
            self.ctx.cost.failures += 1
            state = "keeps running" if leave_running else "was not stopped by a dump"
            log.error("snapshot failed (the workload %s): %s", state, e)
            self.ctx.board.report(failures=self.ctx.status.failures + 1, last_error=str(e)[:500],
                         last_error_at=time.time())
            return None
        finally:
            if entry is None and image_dir is not None:
                shutil.rmtree(image_dir, ignore_errors=True)
            elif not handed and self.spool is not None:
                self.spool.spool.remove(entry)
        done = time.monotonic()
        self.ctx.cost.seconds = done - started
        figures = {"seq": report.manifest.seq, "frozen_ms": report.frozen_us / 1000,
                   **gpu_figures,
                   "dump_s": round(dumped - started, 3), "ingest_s": round(done - dumped, 3),
                   "image_bytes": report.image_bytes, "bytes_written": report.bytes_written,
                   "staging_bytes": staged,
                   "staging": self._staging_medium.value if self._staging_medium else None}
        self.ctx.cost.history.append(figures)
        st = self.ctx.status
        self.ctx.board.report(snapshots=st.snapshots + 1, frozen_seconds=st.frozen_seconds +
                     report.frozen_us / 1e6, gpu_stall_seconds=st.gpu_stall_seconds + gpu_stall_s,
                     stall_seconds=st.stall_seconds + dumped - started,
                     bytes_written=st.bytes_written + report.bytes_written,
                     last_seq=report.manifest.seq, last_success_at=time.time())
        if self.ctx.mark is not None:
            self.ctx.mark.record(report.manifest.seq)
        log.warning("snapshot seq %d committed: frozen %.0f ms (CRIU)%s, image %.1f MB, written "
                    "%.1f MB (%.0f%%), staging %.1f MB in %s, dump %.2fs + ingest %.2fs",
                    report.manifest.seq, report.frozen_us / 1000, gpu_text(gpu_figures),
                    report.image_bytes / 1e6,
                    report.bytes_written / 1e6,
                    100 * report.bytes_written / max(report.image_bytes, 1), staged / 1e6,
                    figures["staging"], dumped - started, done - dumped)
        return Saved(seq=report.manifest.seq)

    def _spooled(self, entry: str, started: float, dumped: float, staged: int,
                 frozen_us: int, gpu_figures: dict[str, float]) -> Saved:
        """Account for a dump handed to the uploader. Its cost — what a final snapshot's
        budget must cover — is the dump and the hand-off, not the upload."""
        done = time.monotonic()
        self.ctx.cost.seconds = done - started
        self.ctx.cost.history.append({"entry": entry, "seq": None, "frozen_ms": frozen_us / 1000,
                                  **gpu_figures,
                                  "dump_s": round(dumped - started, 3),
                                  "handoff_s": round(done - dumped, 3), "image_bytes": staged,
                                  "bytes_written": 0, "staging_bytes": staged})
        st = self.ctx.status
        gpu_stall_s = gpu_figures["gpu_stall_ms"] / 1000
        self.ctx.board.report(spooled=st.spooled + 1, frozen_seconds=st.frozen_seconds + frozen_us / 1e6,
                     gpu_stall_seconds=st.gpu_stall_seconds + gpu_stall_s,
                     stall_seconds=st.stall_seconds + dumped - started)
        log.warning("snapshot spooled as entry %s: frozen %.0f ms (CRIU)%s, image %.1f MB, dump "
                    "%.2fs + hand-off %.2fs; the sidecar uploads it", entry, frozen_us / 1000,
                    gpu_text(gpu_figures),
                    staged / 1e6, dumped - started, done - dumped)
        return Saved(entry=entry)

    def poll_spool(self) -> None:
        if self.spool is not None:
            self.spool.poll()

    def account_upload(self, result: spool_mod.Result) -> None:
        """Count the uploader's verdict on one of this run's entries (a fence is acted on in
        the loop)."""
        outcome = result.outcome
        if outcome is spool_mod.UploadOutcome.COMMITTED and result.seq is not None:
            for figures in self.ctx.cost.history:
                if figures.get("entry") == result.entry:
                    figures.update(seq=result.seq, bytes_written=result.bytes_written,
                                   upload_s=result.upload_s)
            st = self.ctx.status
            self.ctx.board.report(snapshots=st.snapshots + 1,
                         bytes_written=st.bytes_written + result.bytes_written,
                         last_seq=max(result.seq, st.last_seq or 0),
                         last_success_at=time.time())
            if self.ctx.mark is not None:
                self.ctx.mark.record(result.seq)
            log.warning("snapshot seq %d committed by the sidecar (entry %s): wrote %.1f MB "
                        "of %.1f MB in %.2fs", result.seq, result.entry,
                        result.bytes_written / 1e6, result.image_bytes / 1e6, result.upload_s)
        elif outcome is spool_mod.UploadOutcome.INVALID:
            self.ctx.cost.failures += 1
            self.ctx.board.report(failures=self.ctx.status.failures + 1,
                         last_error=f"entry {result.entry}: {result.detail}"[:500],
                         last_error_at=time.time())
            log.error("the sidecar dropped entry %s: %s", result.entry, result.detail)
        elif outcome is not spool_mod.UploadOutcome.FENCED:
            log.info("entry %s: %s (%s)", result.entry, outcome.value, result.detail)

    def spool_busy(self) -> bool:
        if self.spool is None:
            return False
        return self.spool.busy(on_stalled=lambda why: self.ctx.board.report(
            last_error=why, last_error_at=time.time()))

    def summarize(self) -> None:
        history = self.ctx.cost.history
        if not history and not self.ctx.cost.failures:
            return
        frozen = sorted(h["frozen_ms"] for h in history)
        written = sum(h["bytes_written"] for h in history)
        image = sum(h["image_bytes"] for h in history)
        spooled = [h for h in history if h.get("entry")]
        by_sidecar = ""
        if spooled:
            committed = sum(1 for h in spooled if h.get("seq") is not None)
            by_sidecar = (f" ({len(spooled)} spooled, {committed} of them committed by the "
                          "sidecar so far)")
        log.warning("%d snapshots%s (%d failed): frozen median %.0f ms, max %.0f ms; wrote %.1f "
                    "MB for %.1f MB of images (%.0f%%); peak staging %.1f MB", len(history),
                    by_sidecar, self.ctx.cost.failures, frozen[len(frozen) // 2] if frozen else 0,
                    frozen[-1] if frozen else 0, written / 1e6, image / 1e6,
                    100 * written / max(image, 1), self.ctx.cost.peak_staging_bytes / 1e6)
