"""Rollback refused across a Job's pods (ADR 0049): the sidecar keeps the committed seqs in the
owner Job's annotation :data:`ANNOTATION`.

A retry of a Job's step is a new pod (``backoffLimit``, a Kueue eviction and readmission), so
the committed-seq file of the pod before (:mod:`cairn.runtime.rollback`) is gone with it; the
Job outlives its pods, and the bucket's writers do not reach it. In a Job pod the transform puts
the files on the shared volume (:data:`~cairn.runtime.env.COMMITTED_DIR` =
``/var/run/cairn/committed`` in both containers) and gives the sidecar a startup probe on
:data:`STARTED_PATH`; the sidecar (``--owner-job``):

- before that probe answers 200, so before the kubelet starts the main container, reads its
  Job once and records each entry of the annotation into the shared directory
  (``record(seq, source=...)``): a try that would begin older than an earlier pod committed
  is refused, naming the annotation. A malformed annotation is logged and ignored; an
  unreadable Job (no grant, API down; one request of ``JobSettings.timeout_s``) is logged and
  the pod starts without it;
- while it runs, from a thread of its own (:class:`JobAnnotation`), polls the directory every
  second and, when a seq advanced, merge-patches the annotation with every entry it knows
  (seeded, read back, in the directory: the newest seq per store and key), conditional on
  the Job's ``resourceVersion`` so that the pods of one Job never drop each other's entries
  (a 409 is read again and merged); once more when the sidecar stops, after the main
  container. The commit path never waits on the API server; a pod lost in the second after
  a commit may leave that seq unpublished, the ones before it are kept.

The annotation is ``[{"store": URL, "key": KEY, "seq": N}, ...]``, compact JSON. Needs
``get`` and ``patch`` on ``jobs`` (:func:`cairn.k8s.rbac.job_reader_rbac`).

A bare pod (no Job) keeps its files on the shared volume too, which protects a restart of its
main container. With ``--owner-pod`` (``with_snapshot_sidecar(committed_in_pod=True)``, which
the Airflow pod operator asks for) the same thread keeps the seqs in the pod's own annotation:
its creator sets the annotation when it creates the pod (from what it kept of the earlier
tries), and reads it back while and after the pod runs, to carry it to the next pod it
creates; that needs ``get`` and ``patch`` on ``pods``
(:func:`cairn.k8s.rbac.pod_annotator_rbac`). Not covered: a JobSet restart (it recreates the
Jobs, annotations and all). The files are the pod's group's (the directory is setgid, so marks
are written 0660 there): a main container that runs as another user than the sidecar, in the
pod's ``fsGroup``, shares them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
from collections.abc import Mapping
from typing import Any

from cairn.exceptions import ConfigError
from cairn.k8s.jobs import JobSettings, OwnerKind, request_job
from cairn.runtime.env import COMMITTED_DIR
from cairn.runtime.rollback import SHARED_MARK_FILE_MODE, local_mark

log = logging.getLogger("cairn.sidecar.committed")

#: The owner Job's annotation that keeps the newest committed seq of each store and key.
ANNOTATION = "cairn.dev/committed-seqs"
#: The shared volume's directory of the committed-seq files, in a Job pod.
DIRECTORY_NAME = "committed"
#: The sidecar's startup probe: 200 once the seqs are copied from the Job (or that gave up).
STARTED_PATH = "/startedz"
#: The probe's tries, a second apart: the interpreter's start on a loaded node plus the one
#: Job read (``JobSettings.timeout_s``, 5 s), with room to spare; past them the kubelet
#: restarts the sidecar and the main container still waits.
STARTUP_FAILURES = 60
POLL_S = 1.0
MAX_BACKOFF_S = 60.0
CONFLICT_TRIES = 5  # 409s in a row (other pods of the Job patching it) before the next poll
#: The directory the sidecar creates: setgid and group-writable, so that the pod's other
#: containers (in its fsGroup, as the spool's are) can write their files beside its own.
SHARED_DIR_MODE = 0o2770
#: The files in that directory (the main container's and the sidecar's, other users of the
#: pod's group), which each reads and replaces.
SHARED_FILE_MODE = SHARED_MARK_FILE_MODE

Entries = dict[tuple[str, str], int]


def pod_settings(shared_path: str, port: int) -> tuple[dict[str, str], dict[str, Any]]:
    """For the transform: the environment both containers of a Job pod get (the
    committed-seq files on the shared volume) and the sidecar's startup probe."""
    probe = {"httpGet": {"path": STARTED_PATH, "port": port}, "periodSeconds": 1,
             "timeoutSeconds": 1, "failureThreshold": STARTUP_FAILURES}
    return {COMMITTED_DIR.name: f"{shared_path}/{DIRECTORY_NAME}"}, probe


def parse_entries(value: object, *, where: str) -> Entries:
    """The entries of an annotation's ``value`` (a JSON list of ``{"store", "key", "seq"}``),
    the newest seq per store and key; a malformed value, or entry, is logged and left out."""
    if value is None:
        return {}
    try:
        items = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        items = None
    if not isinstance(items, list):
        log.warning("ignoring %s: not a JSON list of committed seqs (%.200r)", where, value)
        return {}
    found: Entries = {}
    for item in items:
        entry = _entry(item)
        if entry is None:
            log.warning("ignoring an entry of %s that is not {\"store\", \"key\", \"seq\"}: "
                        "%.200r", where, item)
            continue
        store, key, seq = entry
        found[(store, key)] = max(seq, found.get((store, key), seq))
    return found


def render(entries: Entries) -> str:
    """The annotation's value for ``entries`` (sorted: equal entries, equal bytes)."""
    items = [{"store": s, "key": k, "seq": seq} for (s, k), seq in sorted(entries.items())]
    return json.dumps(items, separators=(",", ":"), sort_keys=True)


def _entry(item: object) -> tuple[str, str, int] | None:
    if not isinstance(item, dict):
        return None
    store, key, seq = item.get("store"), item.get("key"), item.get("seq")
    if not (isinstance(store, str) and store and isinstance(key, str) and key
            and isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0):
        return None
    return store, key, seq


def _mark_name(entry: tuple[str, str, int], environ: Mapping[str, str]) -> str | None:
    try:
        return os.path.basename(local_mark(entry[0], entry[1], environ).path)
    except ConfigError:  # not a store URL
        return None


def _merge(into: Entries, entries: Mapping[tuple[str, str], int]) -> None:
    for name, seq in entries.items():
        into[name] = max(seq, into.get(name, seq))


class SharedMarks:
    """The committed-seq files in ``directory``, which the pod's containers share. Any thread
    may call :meth:`record`; :meth:`scan` only reads."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.environ = {COMMITTED_DIR.name: directory}
        self._warned: set[str] = set()

    def prepare(self) -> None:
        """Create the directory, group-shared (:data:`SHARED_DIR_MODE`), unless it exists: a
        directory someone else made keeps its mode. Never raises (logged)."""
        try:
            os.makedirs(os.path.dirname(self.directory) or ".", exist_ok=True)
            os.mkdir(self.directory)
        except FileExistsError:
            return
        except OSError as e:
            log.error("cannot create the committed-seq directory %s: %s", self.directory, e)
            return
        try:
            os.chmod(self.directory, SHARED_DIR_MODE)
        except OSError as e:
            log.warning("cannot share %s with the pod's group: %s", self.directory, e)

    def record(self, store_url: str, key: str, seq: int, *, source: str | None = None) -> bool:
        """``local_mark(...).record(seq, source=)`` (readable by the pod's group where the
        directory is group-shared); True when the mark moved. Raises :class:`OSError`, and
        :class:`~cairn.exceptions.ConfigError` for a store URL that is none."""
        return local_mark(store_url, key, self.environ).record(seq, source=source)

    def record_commit(self, store_url: str, key: str, seq: int) -> None:
        """The uploader committed ``seq`` (its thread): recorded before the main container
        hears of it, so that its own record finds the seq there. Never raises (logged)."""
        try:
            self.record(store_url, key, seq)
        except (OSError, ConfigError) as e:
            log.error("cannot record committed seq %d of %s in %s: %s", seq, key,
                      self.directory, e)

    def scan(self) -> Entries:
        """Every mark in the directory, the newest seq per store and key. A file that cannot
        be read (another user's, outside the pod's group) or is not a mark is logged once and
        left out."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        except OSError as e:
            self._warn_once(self.directory, f"cannot list {self.directory} ({e}): the commits "
                            "recorded there are not kept in the Job's annotation")
            return {}
        found: Entries = {}
        for name in sorted(names):
            if name.startswith(".") or not name.endswith(".json"):
                continue  # write_json_atomic's temporary files are dot files
            path = os.path.join(self.directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                self._warn_once(path, f"cannot read the committed-seq record {path} ({e}): its "
                                "commits are not kept in the Job's annotation")
                continue
            entry = _entry(doc)
            if entry is None or _mark_name(entry, self.environ) != name:
                self._warn_once(path, f"ignoring {path}: not a committed-seq record")
                continue
            _merge(found, {(entry[0], entry[1]): entry[2]})
        return found

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)


class JobAnnotation(threading.Thread):
    """Seeds the shared directory from the Job's annotation (:meth:`seed`, first thing in
    :meth:`run`; :attr:`seeded` set when it is done or gave up), then keeps the annotation
    up with the directory (:meth:`sync` every ``poll_s``, and once more in :meth:`stop`).
    Only this thread talks to the API server and touches :attr:`known` and
    :attr:`published`."""

    def __init__(self, settings: JobSettings, marks: SharedMarks, *,
                 poll_s: float = POLL_S) -> None:
        super().__init__(name=f"cairn-committed {settings.namespace}/{settings.name}",
                         daemon=True)
        self.settings, self.marks, self.poll_s = settings, marks, poll_s
        self.job = settings.describe
        self.source = f"the annotation {ANNOTATION} of {self.job}"
        self.seeded = threading.Event()
        self.known: Entries = {}  # seeded, read back from the Job, or in the directory
        self.published: Entries = {}  # what the annotation held when last read or patched
        self._version: str | None = None  # the Job's resourceVersion when last read
        self._stopping = threading.Event()
        self._failures = 0
        self._retry_at = 0.0

    def run(self) -> None:
        self.seed()
        while not self._stopping.wait(self.poll_s):
            self._sync_logged()
        self._sync_logged(final=True)

    def _sync_logged(self, *, final: bool = False) -> None:
        try:
            self.sync(final=final)
        except Exception as e:  # noqa: BLE001 - the thread must not die silently
            log.exception("keeping the committed seqs in %s failed: %s", self.source, e)

    def seed(self) -> None:
        """Record each entry of the annotation into the shared directory. Never raises."""
        try:
            try:
                job = request_job(self.settings)
            except (OSError, ValueError) as e:
                log.warning("cannot read %s (%s): %s", self.source,
                            _reason(e, self.settings.kind), _unprotected(self.settings.kind))
                return
            self._version = _version(job)
            kept = parse_entries(_annotation(job), where=self.source)
            copied = []
            for (store, key), seq in sorted(kept.items()):
                try:
                    if self.marks.record(store, key, seq, source=self.source):
                        copied.append(f"{key} seq {seq}")
                except (OSError, ConfigError) as e:
                    log.error("cannot record committed seq %d of %s in %s: %s", seq, key,
                              self.marks.directory, e)
            if copied:  # one line, however many indexes the Job has
                more = f" and {len(copied) - 5} more" if len(copied) > 5 else ""
                earlier = (f"earlier pods of {self.job}" if self.settings.kind is OwnerKind.JOB
                           else f"earlier tries (as the creator of {self.job} recorded them)")
                log.warning("%s committed %s%s (kept in %s): a try here refuses to begin "
                            "older", earlier, ", ".join(copied[:5]), more, ANNOTATION)
            _merge(self.known, kept)
            self.published = dict(kept)
        finally:
            self.seeded.set()

    def sync(self, *, final: bool = False) -> bool:
        """Patch the annotation if a seq in the directory is newer than it holds (after a
        failure, not before its backoff ran out, unless ``final``); True when the annotation
        is up to date."""
        _merge(self.known, self.marks.scan())
        if not self._ahead():
            return True
        if not final and time.monotonic() < self._retry_at:
            return False
        try:
            self._publish()
        except (OSError, ValueError) as e:
            if self._failures == 0:
                log.warning("cannot keep the committed seqs in %s (%s): %s", self.source,
                            _reason(e, self.settings.kind),
                            _unprotected(self.settings.kind) if _denied(e) else
                            "trying again")
            self._failures += 1
            self._retry_at = time.monotonic() + min(MAX_BACKOFF_S,
                                                    self.poll_s * 2 ** self._failures)
            return False
        if self._failures:
            log.warning("%s keeps the committed seqs again", self.source)
        self._failures = 0
        return True

    def _ahead(self) -> bool:
        return any(seq > self.published.get(name, -1) for name, seq in self.known.items())

    def _publish(self) -> None:
        for _ in range(CONFLICT_TRIES):
            if self._version is None:
                job = request_job(self.settings)
                _merge(self.known, parse_entries(_annotation(job), where=self.source))
                self._version = _version(job)
            sent = dict(self.known)
            metadata: dict[str, Any] = {"annotations": {ANNOTATION: render(sent)}}
            if self._version is not None:
                # The precondition: a pod of the Job that patched it since our read gets a
                # 409 rather than losing its entries to ours.
                metadata["resourceVersion"] = self._version
            try:
                job = request_job(self.settings, merge_patch={"metadata": metadata})
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    raise
                self._version = None  # read it again, merge, and patch that
                continue
            self._version = _version(job)
            self.published = sent
            log.info("kept committed seqs %s in %s", render(sent), self.source)
            return
        raise OSError(f"{CONFLICT_TRIES} conflicting updates of {self.job} in a row")

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Publish what is left and stop; gives up waiting after ``timeout_s`` (a daemon
        thread: an unreachable API server does not hold the exit)."""
        self._stopping.set()
        if self.is_alive():
            self.join(timeout_s)
        if self.is_alive():
            log.warning("keeping the committed seqs in %s did not finish within %.0f s",
                        self.source, timeout_s)


def _unprotected(kind: OwnerKind) -> str:
    nxt = ("the Job's next pod cannot" if kind is OwnerKind.JOB
           else "the next pod its creator makes for a retry cannot")
    return (f"only the file in this pod protects a restart of its main container; {nxt} "
            "tell whether snapshots were deleted behind its back")


def _denied(error: BaseException) -> bool:
    return isinstance(error, urllib.error.HTTPError) and error.code in (401, 403)


def _reason(error: BaseException, kind: OwnerKind) -> str:
    if isinstance(error, urllib.error.HTTPError):
        grant = ("get and patch on jobs (cairn.k8s.job_reader_rbac)" if kind is OwnerKind.JOB
                 else "get and patch on pods (cairn.k8s.pod_annotator_rbac)")
        hint = f": grant the pod's service account {grant}" if _denied(error) else ""
        return f"the API server answered {error.code}{hint}"
    return str(error)


def _annotation(job: Mapping[str, Any]) -> object:
    metadata = job.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    return annotations.get(ANNOTATION) if isinstance(annotations, dict) else None


def _version(job: Mapping[str, Any]) -> str | None:
    metadata = job.get("metadata")
    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    return version if isinstance(version, str) and version else None
