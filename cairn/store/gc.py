"""Garbage collection: delete packs that no manifest references and nobody used lately.

Safety argument (docs/adr/0003-gc-and-dedup.md): packs are listed *before* manifests are
read. A pack is deleted only when no manifest references it and its last create-or-touch is
older than the grace period, and the delete is guarded by the version seen in the listing.
A writer touches every pack it reuses before recording the reference and commits within half
the grace, so a pack it relies on is either seen as recently used, or its version changed and
the guarded delete fails, or the touch finds it gone and the writer writes the chunk again.
On a backend whose deletes a touch cannot guard (S3), a pack is condemned first and deleted
by a pass a grace period later (:mod:`cairn.store.condemned`, ADR 0048).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from cairn.exceptions import CorruptSnapshot, NotFound, PreconditionFailed
from cairn.store.backend import Backend, ObjectInfo
from cairn.store.condemned import Condemnation, condemn, read_condemnations
from cairn.store.local import LocalBackend
from cairn.store.packs import PACKS_PREFIX
from cairn.store.manifest import manifest_from_json
from cairn.store.slotlog import SlotLog, key_paths, parts_prefix


log = logging.getLogger(__name__)


class GcStore(Protocol):
    """What a GC pass uses of its store (:class:`cairn.store.Store` is one)."""

    backend: Backend
    gc_grace_seconds: float


@dataclass
class GCReport:
    packs_total: int = 0
    packs_referenced: int = 0
    packs_in_grace: int = 0
    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    raced: list[str] = field(default_factory=list)
    unreadable_records: list[str] = field(default_factory=list)
    temporaries_removed: int = 0
    stale_parts_removed: int = 0
    #: Packs this pass condemned (deleted by a pass a grace period later), and packs an
    #: earlier condemnation holds that are not yet due (backends without guarded deletes).
    condemned: list[str] = field(default_factory=list)
    packs_condemned_earlier: int = 0
    dry_run: bool = False


def _live_part_packs(store: GcStore, path: str, *, now: float, grace: float, report: GCReport,
                     dry_run: bool) -> set[str]:
    """Packs referenced by rank parts still in flight; parts older than the grace are stale
    (their distributed snapshot was fenced or crashed) and are deleted."""
    packs: set[str] = set()
    backend = store.backend
    for info in backend.list(parts_prefix(path)):
        if now - info.updated > grace:
            report.stale_parts_removed += 1
            if not dry_run:
                try:
                    backend.delete(info.name, if_version=info.version)
                except (PreconditionFailed, NotFound):
                    pass
            continue
        # The read stays outside the parsing's except: a library error while reading must
        # stop the pass, never leave this part's packs unprotected as "unreadable".
        try:
            data = backend.read(info.name)
        except NotFound:
            continue
        except CorruptSnapshot as e:  # a sealed part that fails authentication
            report.unreadable_records.append(f"{info.name}: {e}")
            continue
        try:
            packs |= manifest_from_json(json.loads(data)["manifest"]).packs()
        except (ValueError, KeyError, TypeError, CorruptSnapshot) as e:
            report.unreadable_records.append(f"{info.name}: {e}")
    return packs


def collect_garbage(store: GcStore, *, grace_seconds: float | None = None,
                    dry_run: bool = False) -> GCReport:
    """One GC pass over the whole store. Safe to run while writers and readers are active."""
    backend = store.backend
    grace = store.gc_grace_seconds if grace_seconds is None else float(grace_seconds)
    report = GCReport(dry_run=dry_run)
    packs = list(backend.list(PACKS_PREFIX))  # before the manifests: see the module docstring
    report.packs_total = len(packs)
    condemnations: list[Condemnation] = []
    if not backend.guarded_deletes:  # also before the manifests (cairn.store.condemned)
        condemnations, unreadable = read_condemnations(backend)
        report.unreadable_records.extend(unreadable)
    referenced: set[str] = set()
    now = time.time()
    # A backend whose clock is kept to the second reports times up to a step earlier than
    # they were: age is counted from the end of the step, never the start.
    grace += backend.version_resolution_seconds
    for path in key_paths(backend):
        referenced |= _live_part_packs(store, path, now=now, grace=grace, report=report,
                                       dry_run=dry_run)
        slot = SlotLog(backend, path)
        for seq in slot.seqs():
            try:
                record = slot.read(seq)
            except NotFound:
                continue
            except CorruptSnapshot as e:
                # Its snapshot cannot be restored anyway; say so rather than keep its packs.
                report.unreadable_records.append(f"{path} seq {seq}: {e}")
                continue
            if record.manifest is None:
                continue
            try:
                referenced |= record.manifest.packs()
            except CorruptSnapshot as e:  # a chunk table that does not decode (ADR 0044)
                report.unreadable_records.append(f"{path} seq {seq}: {e}")
    due = {}  # pack -> version, condemned at least a grace period ago
    pending: set[str] = set()
    for c in condemnations:
        if now - c.created >= grace:
            due.update(c.packs)
        else:
            pending.update(c.packs)
    to_condemn: dict[str, str] = {}
    for info in packs:
        if info.name in referenced:
            report.packs_referenced += 1
            continue
        if now - info.updated < grace:
            report.packs_in_grace += 1
            continue
        if not backend.guarded_deletes and due.get(info.name) != info.version:
            if info.name in pending:
                report.packs_condemned_earlier += 1
            else:
                to_condemn[info.name] = info.version
            continue
        _delete_pack(backend, info, report, dry_run=dry_run)
    if to_condemn:
        report.condemned.extend(sorted(to_condemn))
        if not dry_run:
            condemn(backend, to_condemn)
    if not dry_run:
        for c in condemnations:
            if now - c.created >= grace:  # every pack it named is deleted, used or changed
                try:
                    backend.delete(c.name)
                except NotFound:
                    pass
    if isinstance(backend, LocalBackend) and not dry_run:
        report.temporaries_removed = backend.remove_stale_temporaries(older_than=now - grace)
    for problem in report.unreadable_records:
        log.warning("gc: unreadable record %s", problem)
    return report


def _delete_pack(backend: Backend, info: ObjectInfo, report: GCReport, *, dry_run: bool) -> None:
    if not dry_run:
        try:
            backend.delete(info.name, if_version=info.version)
        except (PreconditionFailed, NotFound):
            report.raced.append(info.name)
            return
    report.deleted.append(info.name)
    report.bytes_freed += info.size
