"""Checkpointer: the few lines a training loop adds to resume where it stopped.

::

    ckpt = Checkpointer.from_env()                    # CAIRN_STORE and CAIRN_KEY
    start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, loader=loader)
    for step in range(start, total):
        ...                                           # one step, optimizer update included
        ckpt.step(step)                               # after the update; may snapshot
    ckpt.close()

Semantics: :meth:`Checkpointer.restore` opens this attempt (fencing any older one), loads
the newest snapshot that verifies and fits, and returns the step to run next (the last
completed step + 1, or 0). :meth:`Checkpointer.step` takes a snapshot when the policy says so;
the snapshot holds the state *after* that step's update.

This first version persists synchronously on the calling thread: when ``step()`` returns
after a snapshot, it is durable. Staging into shared memory and persisting from a separate
writer process (so training stalls only for a memory copy) builds on this format.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import ConfigError, CorruptSnapshot
from cairn.state import capture
from cairn.state.codec import (
    STATE_SCHEMA,
    ArrayHeader,
    array_from_bytes,
    cpu_bytes,
    flatten,
    header_of,
    unflatten,
)
from cairn.store import Key, Manifest, SnapshotMode, Store, open_store

log = logging.getLogger(__name__)

STATE_FILE = "state.json"


def tensor_path(index: int) -> str:
    return f"tensors/{index:06d}"


@dataclass(frozen=True)
class SnapshotPolicy:
    """When :meth:`Checkpointer.step` snapshots: every ``every_steps`` steps and/or every
    ``every_seconds`` seconds (whichever comes first)."""

    every_steps: int | None = None
    every_seconds: float | None = 600.0

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ConfigError("every_steps must be at least 1")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ConfigError("every_seconds must be positive")
        if self.every_steps is None and self.every_seconds is None:
            raise ConfigError("give every_steps, every_seconds or both; otherwise nothing is saved")


def save_state(store_attempt: Any, tree: dict[str, Any], *, step: int) -> Manifest:
    """Write ``tree`` as one state snapshot of ``store_attempt``; durable when it returns."""
    structure, arrays = flatten(tree)
    headers = [header_of(a).to_json() for a in arrays]
    with store_attempt.snapshot(mode=SnapshotMode.STATE) as snap:
        for index, array in enumerate(arrays):
            snap.add_bytes(tensor_path(index), cpu_bytes(array))
        doc = {"schema": STATE_SCHEMA, "step": step, "structure": structure, "arrays": headers}
        snap.add_bytes(STATE_FILE, json.dumps(doc, separators=(",", ":")).encode())
        return snap.commit(step=step)


def load_state(store: Store, manifest: Manifest) -> dict[str, Any]:
    """Read and verify a whole state snapshot into CPU memory. Raises CorruptSnapshot."""
    if manifest.mode is not SnapshotMode.STATE:
        raise CorruptSnapshot(f"seq {manifest.seq} is a {manifest.mode.value} snapshot, not "
                              "framework state", seq=manifest.seq)
    reader = store.reader(manifest)
    try:
        doc = json.loads(reader.read_file(STATE_FILE))
        if doc.get("schema") != STATE_SCHEMA:
            raise CorruptSnapshot(f"state schema {doc.get('schema')!r} is unknown; upgrade cairn",
                                  seq=manifest.seq)
        headers = [ArrayHeader.from_json(h) for h in doc["arrays"]]
        structure = doc["structure"]
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptSnapshot(f"seq {manifest.seq}: state index is unreadable: {e}",
                              seq=manifest.seq) from None
    arrays = []
    for index, header in enumerate(headers):
        try:
            entry = manifest.file(tensor_path(index))
        except KeyError:
            raise CorruptSnapshot(f"seq {manifest.seq}: {tensor_path(index)} is missing",
                                  seq=manifest.seq) from None
        if entry.size != header.nbytes:
            raise CorruptSnapshot(f"seq {manifest.seq}: {entry.path} holds {entry.size} bytes, "
                                  f"its header says {header.nbytes}", seq=manifest.seq)
        buffer = bytearray(entry.size)
        view = memoryview(buffer)
        position = 0
        for piece in reader.iter_file(entry.path):
            view[position:position + len(piece)] = piece
            position += len(piece)
        arrays.append(array_from_bytes(header, buffer))
    tree = unflatten(structure, arrays)
    if not isinstance(tree, dict) or "step" not in tree:
        raise CorruptSnapshot(f"seq {manifest.seq}: state has no step", seq=manifest.seq)
    return tree


class Checkpointer:
    """Snapshots a training loop's state into a cairn store and resumes from it.

    One thread uses a Checkpointer. Call :meth:`restore` first: it opens the attempt and names
    the objects every later snapshot captures.
    """

    def __init__(self, *, store: str | Store, key: str | Key,
                 policy: SnapshotPolicy | None = None, every_steps: int | None = None,
                 every_seconds: float | None = None) -> None:
        if policy is None:
            policy = (SnapshotPolicy(every_steps=every_steps, every_seconds=every_seconds)
                      if every_steps is not None or every_seconds is not None else SnapshotPolicy())
        self.policy = policy
        self._owns_store = not isinstance(store, Store)
        self.store = open_store(store) if isinstance(store, str) else store
        self.key = Key.parse(key) if isinstance(key, str) else key
        self._attempt: Any = None
        self._targets: capture.Targets | None = None
        self.extras: dict[str, Any] = {}
        self.restored_from: Manifest | None = None
        self.last_snapshot: Manifest | None = None
        self._last_time = time.monotonic()
        self._last_step: int | None = None

    @classmethod
    def from_env(cls, **options: Any) -> Checkpointer:
        """From ``CAIRN_STORE`` and ``CAIRN_KEY`` (set by the Airflow operator or KFP component),
        plus optional ``CAIRN_EVERY_STEPS`` and ``CAIRN_EVERY_SECONDS``."""
        store, key = os.environ.get("CAIRN_STORE"), os.environ.get("CAIRN_KEY")
        if not store or not key:
            raise ConfigError("CAIRN_STORE and CAIRN_KEY must be set (the cairn Airflow operator "
                              "and KFP component set them); or use Checkpointer(store=..., key=...)")
        env_steps, env_seconds = os.environ.get("CAIRN_EVERY_STEPS"), os.environ.get("CAIRN_EVERY_SECONDS")
        try:
            if env_steps and "every_steps" not in options:
                options["every_steps"] = int(env_steps)
            if env_seconds and "every_seconds" not in options:
                options["every_seconds"] = float(env_seconds)
        except ValueError:
            raise ConfigError("CAIRN_EVERY_STEPS must be an integer and CAIRN_EVERY_SECONDS a "
                              "number of seconds") from None
        return cls(store=store, key=key, **options)

    def restore(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                scaler: Any = None, loader: Any = None, models: dict[str, Any] | None = None,
                optimizers: dict[str, Any] | None = None) -> int:
        """Open the attempt, load the newest snapshot that verifies, return the next step.

        All or nothing: a snapshot that fails verification is skipped (logged) for the one
        before it; one that does not fit the live objects raises
        :class:`~cairn.state.capture.StateMismatch` before anything is loaded.
        """
        if self._attempt is not None:
            raise ConfigError("restore() was already called on this Checkpointer")
        if model is not None and models is not None or optimizer is not None and optimizers is not None:
            raise ConfigError("pass model= or models=, optimizer= or optimizers=, not both")
        self._targets = capture.Targets(
            models=capture.named(models if models is not None else model, "model"),
            optimizers=capture.named(optimizers if optimizers is not None else optimizer, "optimizer"),
            schedulers=capture.named(scheduler, "scheduler"),
            scalers=capture.named(scaler, "scaler"),
            loader=loader,
        )
        self._attempt = self.store.open_attempt(self.key, note={"mode": "state"})
        for info in self.store.snapshots(self.key):
            try:
                tree = load_state(self.store, info.manifest)
            except CorruptSnapshot as e:
                log.warning("key %s: skipping snapshot seq %d: %s", self.key, info.seq, e)
                continue
            capture.check_compatible(tree, self._targets)
            capture.apply(tree, self._targets)
            self.extras = dict(tree.get("extras") or {})
            self.restored_from = info.manifest
            self._attempt.resume_from(info.manifest)
            self._last_step = int(tree["step"])
            log.info("key %s: resumed from seq %d (step %d)", self.key, info.seq, self._last_step)
            return self._last_step + 1
        return 0

    def step(self, step: int) -> bool:
        """Call after ``step``'s optimizer update. Snapshots when the policy says so; returns
        whether it did. Raises :class:`~cairn.exceptions.Fenced` if a newer attempt exists."""
        self._require_restored()
        policy = self.policy
        due = (policy.every_steps is not None and (step + 1) % policy.every_steps == 0) or (
            policy.every_seconds is not None
            and time.monotonic() - self._last_time >= policy.every_seconds)
        if due:
            self.save(step)
        return due

    def save(self, step: int) -> Manifest:
        """Snapshot now, as of after ``step``; durable when it returns."""
        self._require_restored()
        assert self._targets is not None
        tree = capture.gather(self._targets, step=step, extras=self.extras)
        self.last_snapshot = save_state(self._attempt, tree, step=step)
        self._last_time = time.monotonic()
        self._last_step = step
        return self.last_snapshot

    def finish(self) -> None:
        """The whole step succeeded: mark the key done and drop its snapshots."""
        self._require_restored()
        self._attempt.finish()

    def close(self) -> None:
        """Release the store. Every snapshot that ``step``/``save`` reported is durable."""
        if self._owns_store:
            self.store.close()

    def _require_restored(self) -> None:
        if self._attempt is None:
            raise ConfigError("call restore(model=..., optimizer=...) before step() or save()")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
