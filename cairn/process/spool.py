"""The spool: the supervisor hands its dumps to an uploader through a shared directory.

On Kubernetes the supervisor (``cairn run --spool DIR``) and the uploader (``cairn sidecar
--upload``) run in two containers that share only a volume. The supervisor's part of a
snapshot ends when CRIU's images and the tracked files are in an *entry* of the spool; the
sidecar hashes, deduplicates and commits it to the store (docs/adr/0014). A final snapshot's
budget then covers the dump only.

Layout of ``DIR``::

    <entry>/                   one dump; named <epoch:012d>-<n:06d>-<unix ms:013d>, so
                               names sort as the dumps were taken (attempt, then counter)
      images/                  CRIU's images (the supervisor dumps straight into it)
      files/<n>                the n-th tracked file, copied up to its dumped size
      ticket.json              written LAST (temporary name + rename): the entry is complete
      ticket.cancelled.json    instead of ticket.json: the supervisor withdrew the entry
    <entry>.result.json        the uploader's verdict: the committed seq, or why it dropped
                               the entry; the supervisor reads and deletes it
    uploader.json              the uploader's heartbeat (rewritten every poll)
    .trash-<entry>/            an entry being deleted (renamed first: never half an entry)

An entry without ``ticket.json`` is never taken. Entries hold process memory (tokens,
credentials) and the command line, so they are readable by the two containers only, through a
shared group: the pod's ``fsGroup`` (set by :mod:`cairn.k8s.transform`) owns the volume with
the setgid bit, so everything made in it belongs to that group, and the sidecar (uid 65532)
is in it. Files are 0640; directories 02770 (group write because the uploader writes its
results and heartbeat here and deletes the entries it committed; setgid so new entries keep
the group). Nothing is world-readable, writable or even traversable (docs/security.md).

Stdlib and ``cairn.store`` only: the sidecar image has no CRIU and no torch.
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import ConfigError, CorruptSnapshot, Fenced, NotFound
from cairn.runtime.channel import write_json_atomic
from cairn.process.images import read_reg_files
from cairn.process.snapshot import IMAGES, FILES, IngestReport, TrackedFile, commit_dump, \
    tracked_sizes
from cairn.store import Key, Store
from cairn.store.delta import DeltaState
from cairn.store.slotlog import Record, RecordKind

log = logging.getLogger("cairn.spool")

SPOOL_VERSION = 1
TICKET = "ticket.json"
CANCELLED = "ticket.cancelled.json"
RESULT_SUFFIX = ".result.json"
HEARTBEAT = "uploader.json"
TRASH_PREFIX = ".trash-"
_ENTRY = re.compile(r"^(\d{12})-(\d{6})-(\d{13})$")
_DIR_MODE = 0o2770  # owner and the shared group only; setgid keeps the group on new entries
_FILE_MODE = 0o640


def entry_name(epoch: int, counter: int, now: float | None = None) -> str:
    """The name of the ``counter``-th entry of attempt ``epoch``; names sort in dump order."""
    if epoch < 0 or counter < 0:
        raise ValueError("epoch and counter are not negative")
    ms = int((time.time() if now is None else now) * 1000)
    return f"{epoch:012d}-{counter:06d}-{ms:013d}"


def parse_entry(name: str) -> tuple[int, int] | None:
    """``(epoch, counter)`` of an entry name, None when ``name`` is not one."""
    m = _ENTRY.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Ticket:
    """What the uploader needs to commit an entry: which attempt it belongs to and what the
    supervisor would have passed to :func:`cairn.process.snapshot.ingest`."""

    entry: str
    key: tuple[str, ...]
    store: str
    epoch: int
    last_seq: int  # the attempt's last seq as the supervisor knew it (the uploader catches up)
    parent_seq: int | None  # the snapshot the attempt restored or last knew committed
    compat: dict[str, Any]
    info: dict[str, Any]
    tracked: tuple[TrackedFile, ...]
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {"version": SPOOL_VERSION, "entry": self.entry, "key": list(self.key),
                "store": self.store, "epoch": self.epoch, "last_seq": self.last_seq,
                "parent_seq": self.parent_seq, "compat": self.compat, "info": self.info,
                "tracked": [{"path": t.path, "size": t.size} for t in self.tracked],
                "created_at": self.created_at}

    @classmethod
    def from_json(cls, doc: Any) -> Ticket:
        if not isinstance(doc, dict):
            raise ConfigError("a spool ticket is a JSON object")
        if doc.get("version") != SPOOL_VERSION:
            raise ConfigError(f"spool ticket version {doc.get('version')!r} is not "
                              f"{SPOOL_VERSION}; run the same cairn version in the sidecar and "
                              "the main container")
        try:
            parent = doc["parent_seq"]
            ticket = cls(
                entry=str(doc["entry"]), key=tuple(str(c) for c in doc["key"]),
                store=str(doc["store"]), epoch=int(doc["epoch"]), last_seq=int(doc["last_seq"]),
                parent_seq=None if parent is None else int(parent),
                compat=dict(doc["compat"]), info=dict(doc["info"]),
                tracked=tuple(TrackedFile(str(t["path"]), int(t["size"]))
                              for t in doc["tracked"]),
                created_at=float(doc["created_at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed spool ticket ({e!r})") from None
        if parse_entry(ticket.entry) is None or ticket.last_seq < ticket.epoch or \
                any(t.size < 0 for t in ticket.tracked):
            raise ConfigError(f"inconsistent spool ticket for entry {ticket.entry!r}")
        Key(ticket.key)  # raises ConfigError naming the rule
        return ticket


class UploadOutcome(str, enum.Enum):
    """What became of an entry."""

    COMMITTED = "committed"  # a snap record holds it (seq)
    FENCED = "fenced"  # a newer attempt took the key: the entry can never be committed
    FINISHED = "finished"  # the attempt marked the key done first: nothing to resume any more
    CANCELLED = "cancelled"  # the supervisor withdrew it (its ticket was renamed)
    SUPERSEDED = "superseded"  # a newer dump of the same attempt was spooled: only it is sent
    INVALID = "invalid"  # an unreadable ticket, or one for another key


@dataclass(frozen=True)
class Result:
    """The uploader's verdict on one entry, left for the supervisor as ``<entry>.result.json``."""

    entry: str
    outcome: UploadOutcome
    epoch: int | None = None
    seq: int | None = None
    detail: str = ""
    bytes_written: int = 0
    image_bytes: int = 0
    frozen_us: int = 0
    upload_s: float = 0.0
    at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"version": SPOOL_VERSION, "entry": self.entry, "outcome": self.outcome.value,
                "epoch": self.epoch, "seq": self.seq, "detail": self.detail,
                "bytes_written": self.bytes_written, "image_bytes": self.image_bytes,
                "frozen_us": self.frozen_us, "upload_s": self.upload_s, "at": self.at}

    @classmethod
    def from_json(cls, doc: Any) -> Result:
        if not isinstance(doc, dict) or doc.get("version") != SPOOL_VERSION:
            raise ConfigError("not a spool result of this cairn version")
        try:
            return cls(entry=str(doc["entry"]), outcome=UploadOutcome(doc["outcome"]),
                       epoch=None if doc.get("epoch") is None else int(doc["epoch"]),
                       seq=None if doc.get("seq") is None else int(doc["seq"]),
                       detail=str(doc.get("detail", "")),
                       bytes_written=int(doc.get("bytes_written", 0)),
                       image_bytes=int(doc.get("image_bytes", 0)),
                       frozen_us=int(doc.get("frozen_us", 0)),
                       upload_s=float(doc.get("upload_s", 0.0)), at=float(doc["at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed spool result ({e!r})") from None


def _read_json(path: str) -> Any:
    """The JSON at ``path``; None when it does not exist. Raises ConfigError when unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e})") from None


def _copy_prefix(source: str, dest: str, size: int) -> None:
    """Copy the first ``size`` bytes of ``source`` (a log the workload may still append to)."""
    with open(source, "rb") as src, open(dest, "wb") as out:
        left = size
        while left:
            data = src.read(min(left, 1 << 20))
            if not data:
                raise ConfigError(f"{source} is shorter than its dumped size {size}; was it "
                                  "truncated since the dump?")
            out.write(data)
            left -= len(data)


def _open_up(path: str) -> None:
    """Make an entry readable and deletable by the other container's user (through the
    shared group), and by nobody else."""
    os.chmod(path, _DIR_MODE)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), _DIR_MODE)
        for name in files:
            os.chmod(os.path.join(root, name), _FILE_MODE)


class Spool:
    """One spool directory, as either side sees it (no state beyond the directory itself,
    except the supervisor's entry counter)."""

    def __init__(self, path: str) -> None:
        if not path:
            raise ConfigError("the spool directory is empty; give --spool DIR on the volume "
                              "shared with `cairn sidecar --upload`")
        self.path = os.path.abspath(path)
        self._counter: dict[int, itertools.count[int]] = {}

    def ensure(self) -> None:
        """Create the directory, writable by its owner and the shared group only (both
        containers' users write in it; see the module docstring)."""
        if not os.path.isdir(self.path):
            os.makedirs(self.path, mode=0o700, exist_ok=True)  # nobody else, even for a moment
            try:
                os.chmod(self.path, _DIR_MODE)
            except PermissionError:
                pass

    def entry_path(self, entry: str) -> str:
        return os.path.join(self.path, entry)

    def images_dir(self, entry: str) -> str:
        return os.path.join(self.path, entry, IMAGES)

    def entries(self) -> list[str]:
        """Every entry directory, complete or not, oldest first."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if parse_entry(n) is not None
                      and os.path.isdir(os.path.join(self.path, n)))

    def is_complete(self, entry: str) -> bool:
        return os.path.exists(os.path.join(self.path, entry, TICKET))

    def is_cancelled(self, entry: str) -> bool:
        return os.path.exists(os.path.join(self.path, entry, CANCELLED))

    def read_ticket(self, entry: str) -> Ticket | None:
        """The entry's ticket; None while it is incomplete (or after it was cancelled).
        Raises ConfigError for an unreadable one."""
        doc = _read_json(os.path.join(self.path, entry, TICKET))
        if doc is None:
            return None
        ticket = Ticket.from_json(doc)
        if ticket.entry != entry:
            raise ConfigError(f"the ticket in {entry} names entry {ticket.entry}")
        return ticket

    def pending(self, epoch: int | None = None) -> list[str]:
        """Complete entries (of attempt ``epoch``, or of any), oldest first."""
        return [e for e in self.entries() if self.is_complete(e)
                and (epoch is None or parse_entry(e)[0] == epoch)]  # type: ignore[index]

    # -- the supervisor's side -------------------------------------------------------------

    def new_entry(self, epoch: int) -> str:
        """Create the next entry of attempt ``epoch`` (its ``images`` directory included) and
        return its name. It stays invisible to the uploader until :meth:`hand_off`."""
        self.ensure()
        if epoch not in self._counter:
            used = [parse_entry(e)[1] for e in self.entries()  # type: ignore[index]
                    if parse_entry(e)[0] == epoch]  # type: ignore[index]
            self._counter[epoch] = itertools.count(max(used, default=0) + 1)
        entry = entry_name(epoch, next(self._counter[epoch]))
        os.makedirs(self.images_dir(entry), mode=0o700)  # opened to the group at hand-off
        return entry

    def hand_off(self, entry: str, *, key: Key, store: str, epoch: int, last_seq: int,
                 parent_seq: int | None, compat: Mapping[str, Any], info: Mapping[str, Any],
                 tracked_paths: Sequence[str], roots: Sequence[str] | None = None) -> Ticket:
        """Complete ``entry`` once CRIU has written its images: copy each tracked file up to
        its dumped size (each under ``roots`` when given), open the entry up to the
        uploader's user, write the ticket last."""
        path = self.entry_path(entry)
        tracked = tracked_sizes(read_reg_files(self.images_dir(entry)), list(tracked_paths),
                                roots=roots)
        files = os.path.join(path, FILES)
        os.makedirs(files, exist_ok=True)
        for index, item in enumerate(tracked):
            _copy_prefix(item.path, os.path.join(files, str(index)), item.size)
        _open_up(path)
        ticket = Ticket(entry=entry, key=key.components, store=store, epoch=epoch,
                        last_seq=last_seq, parent_seq=parent_seq, compat=dict(compat),
                        info=dict(info), tracked=tuple(tracked), created_at=time.time())
        # 0640 from its first moment: the command line is in it.
        write_json_atomic(os.path.join(path, TICKET), ticket.to_json(), mode=_FILE_MODE)
        return ticket

    def cancel(self, entry: str) -> bool:
        """Withdraw a complete entry (the uploader will not start it; one it has started
        fails or is refused by the store, see :func:`upload`). False when it had no ticket."""
        path = self.entry_path(entry)
        try:
            os.replace(os.path.join(path, TICKET), os.path.join(path, CANCELLED))
        except FileNotFoundError:
            return False
        return True

    def remove(self, entry: str) -> None:
        """Delete an entry: renamed aside first, so nobody sees half of one."""
        trash = os.path.join(self.path, TRASH_PREFIX + entry)
        try:
            os.replace(self.entry_path(entry), trash)
        except FileNotFoundError:
            return
        except OSError:  # e.g. a stale trash directory of the same name
            shutil.rmtree(trash, ignore_errors=True)
            try:
                os.replace(self.entry_path(entry), trash)
            except OSError:
                shutil.rmtree(self.entry_path(entry), ignore_errors=True)
                return
        shutil.rmtree(trash, ignore_errors=True)

    def sweep_trash(self) -> None:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(TRASH_PREFIX):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)

    # -- results and the heartbeat ---------------------------------------------------------

    def write_result(self, result: Result) -> None:
        write_json_atomic(os.path.join(self.path, result.entry + RESULT_SUFFIX), result.to_json(),
                          mode=_FILE_MODE)

    def results(self) -> list[Result]:
        """Results not yet taken, oldest entry first (unreadable ones are logged, deleted)."""
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if not name.endswith(RESULT_SUFFIX) or \
                    parse_entry(name[:-len(RESULT_SUFFIX)]) is None:
                continue
            path = os.path.join(self.path, name)
            try:
                doc = _read_json(path)
                if doc is not None:
                    out.append(Result.from_json(doc))
            except ConfigError as e:
                log.warning("discarding %s: %s", name, e)
                self.discard_result(name[:-len(RESULT_SUFFIX)])
        return out

    def discard_result(self, entry: str) -> None:
        try:
            os.unlink(os.path.join(self.path, entry + RESULT_SUFFIX))
        except FileNotFoundError:
            pass

    def write_heartbeat(self, doc: Mapping[str, Any]) -> None:
        write_json_atomic(os.path.join(self.path, HEARTBEAT),
                          {"version": SPOOL_VERSION, **doc, "updated_at": time.time()},
                          mode=_FILE_MODE)

    def heartbeat(self) -> dict[str, Any] | None:
        try:
            doc = _read_json(os.path.join(self.path, HEARTBEAT))
        except ConfigError:
            return None
        return doc if isinstance(doc, dict) else None

    def uploader_alive(self, max_age_s: float = 10.0) -> bool:
        """Whether an uploader wrote its heartbeat within ``max_age_s``."""
        doc = self.heartbeat()
        try:
            return doc is not None and time.time() - float(doc["updated_at"]) <= max_age_s
        except (KeyError, TypeError, ValueError):
            return False


# -- the uploader's side: commit one entry ---------------------------------------------------

class Withdrawn(Exception):
    """The supervisor cancelled the entry while it was being uploaded."""


def _record(store: Store, key: Key, seq: int) -> Record | None:
    try:
        return store.log(key).read(seq)
    except (NotFound, CorruptSnapshot):
        return None


def _entry_of(record: Record) -> str | None:
    """The spool entry a ``snap`` record was committed from (None: not from a spool)."""
    if record.manifest is None:
        return None
    process = (record.manifest.metadata.get("user") or {}).get("process") or {}
    entry = process.get("spool_entry")
    return entry if isinstance(entry, str) else None


def upload(store: Store, spool: Spool, ticket: Ticket, *,
           deltas: dict[tuple[str, ...], DeltaState] | None = None) -> Result:
    """Commit ``ticket``'s entry as the next snapshot of its attempt, from this process.

    The attempt is taken over with :meth:`Store.resume_attempt` (records this uploader
    committed earlier are adopted; a newer attempt's record fences it). ``deltas``, kept by
    the caller from one upload to the next, carries each key's page-delta state (what the
    last commit's page chunks were), so that a dump that changed scattered pages is stored as
    page deltas here too (ADR 0022). Never commits after
    the attempt's own ``done``: a ``snap`` there would be listed as resumable. Idempotent: an
    entry whose commit landed before this process could say so is found by its name in the
    newest snapshot's metadata and not committed twice. Raises on a failure worth retrying
    (the store unreachable, ...); the caller keeps the entry."""
    key = Key(ticket.key)
    started = time.monotonic()
    attempt = store.resume_attempt(key, epoch=ticket.epoch, last_seq=ticket.last_seq,
                                   parent_seq=ticket.parent_seq)
    if deltas is not None:
        attempt.carry_deltas(deltas.pop(key.components, None))
    if attempt.fenced:
        return Result(ticket.entry, UploadOutcome.FENCED, ticket.epoch,
                      detail=f"a newer attempt opened key {key} after epoch {ticket.epoch}")
    tail = _record(store, key, attempt.log.last_seq)
    if tail is not None and tail.kind is RecordKind.DONE:
        return Result(ticket.entry, UploadOutcome.FINISHED, ticket.epoch,
                      detail=f"key {key} was marked done at seq {tail.seq}")
    if tail is not None and _entry_of(tail) == ticket.entry:
        return Result(ticket.entry, UploadOutcome.COMMITTED, ticket.epoch, seq=tail.seq,
                      detail="committed before this uploader could report it")
    entry_path = spool.entry_path(ticket.entry)
    sources = [os.path.join(entry_path, FILES, str(i)) for i in range(len(ticket.tracked))]

    def still_wanted() -> None:
        if not spool.is_complete(ticket.entry):
            raise Withdrawn(ticket.entry)

    try:
        report: IngestReport = commit_dump(
            attempt, spool.images_dir(ticket.entry), tracked=ticket.tracked, sources=sources,
            compat=ticket.compat, info={**ticket.info, "spool_entry": ticket.entry},
            before_commit=still_wanted)
    except Withdrawn:
        return Result(ticket.entry, UploadOutcome.CANCELLED, ticket.epoch,
                      detail="withdrawn by the supervisor during the upload")
    except Fenced:
        taken = _record(store, key, attempt.log.next_seq)
        if taken is not None and taken.epoch == ticket.epoch and taken.kind is RecordKind.DONE:
            return Result(ticket.entry, UploadOutcome.FINISHED, ticket.epoch,
                          detail=f"key {key} was marked done at seq {taken.seq} meanwhile")
        if taken is not None and taken.epoch == ticket.epoch and _entry_of(taken) == ticket.entry:
            return Result(ticket.entry, UploadOutcome.COMMITTED, ticket.epoch, seq=taken.seq,
                          detail="committed by another uploader")
        return Result(ticket.entry, UploadOutcome.FENCED, ticket.epoch,
                      detail=f"seq {attempt.log.next_seq} of key {key} was taken by another "
                             "attempt")
    if deltas is not None:
        deltas[key.components] = attempt.deltas
    return Result(ticket.entry, UploadOutcome.COMMITTED, ticket.epoch, seq=report.manifest.seq,
                  bytes_written=report.bytes_written, image_bytes=report.image_bytes,
                  frozen_us=report.frozen_us, upload_s=round(time.monotonic() - started, 3))
