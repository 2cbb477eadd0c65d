"""Condemned packs: garbage collection on a backend whose deletes a touch cannot guard
(``Backend.guarded_deletes`` False: S3, whose DeleteObject ``If-Match`` names the ETag, which
a touch keeps). ADR 0048 has the argument; in short:

A GC pass does not delete an unreferenced pack the first time it finds one: it records the
pack, with the version it listed, in a **condemnation** ``gc/condemned/<time>-<id>``. A later
pass, once that record is a grace period old, deletes each pack it names that is still
unreferenced and unchanged, then the record. A writer reads every condemnation before it
first reuses a pack and never reuses a condemned one (it writes the chunk again), and commits
within half the grace of its start (:class:`~cairn.exceptions.SnapshotTooSlow` otherwise):

* a writer that read the condemnations before a pack was condemned has committed before the
  condemnation is half a grace old, so the pass that deletes, which reads the manifests after
  that, sees its reference and keeps the pack;
* a writer that read them afterwards does not reuse the pack; once the pack is deleted, so is
  the record, and a writer that reads then finds the pack gone when it touches it.

Records go through the store's backend, so an encrypted store seals them like any record.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from cairn.exceptions import CorruptSnapshot, NotFound
from cairn.store.backend import Backend

CONDEMNED_PREFIX = "gc/condemned/"


@dataclass(frozen=True)
class Condemnation:
    """One record: the packs a pass condemned, each with the version it listed, and when the
    record was created (the backend's clock, as for the packs' ``updated``)."""

    name: str
    created: float
    packs: Mapping[str, str]


def read_condemnations(backend: Backend) -> tuple[list[Condemnation], list[str]]:
    """Every condemnation, and a line for each record that does not parse or authenticate
    (never acted on). A failure to read (network, permissions) raises: it is not a bad
    record."""
    found: list[Condemnation] = []
    unreadable: list[str] = []
    for info in backend.list(CONDEMNED_PREFIX):
        try:
            data = backend.read(info.name)
        except NotFound:  # a pass finished with it meanwhile
            continue
        except CorruptSnapshot as e:
            unreadable.append(f"{info.name}: {e}")
            continue
        try:
            packs = json.loads(data)["packs"]
            if not isinstance(packs, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in packs.items()):
                raise ValueError("packs is not a map of names to versions")
        except (ValueError, KeyError, TypeError) as e:
            unreadable.append(f"{info.name}: {e}")
            continue
        found.append(Condemnation(name=info.name, created=info.updated, packs=packs))
    return found, unreadable


def condemned_packs(backend: Backend) -> frozenset[str]:
    """The packs some condemnation names: a writer must not reuse them."""
    condemnations, _ = read_condemnations(backend)
    return frozenset(name for c in condemnations for name in c.packs)


def condemn(backend: Backend, packs: Mapping[str, str]) -> str:
    """Record ``packs`` (name -> version listed) as condemned; returns the record's name.
    Durable when this returns."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"{CONDEMNED_PREFIX}{stamp}-{uuid.uuid4().hex[:12]}"
    backend.create(name, json.dumps({"packs": dict(sorted(packs.items()))}).encode())
    return name
