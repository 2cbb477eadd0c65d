"""Telling a Kueue eviction from a node drain: the sidecar reads its owner Job's ``spec.suspend``.

Kueue evicts a workload by setting its Job's ``spec.suspend: true``; the Job controller then
deletes the pods, which get SIGTERM and their grace, exactly as in a drain. Only the Job tells
the two apart. A native sidecar gets its own SIGTERM only after the main container has exited,
so it answers the supervisor's ask instead (:mod:`cairn.runtime.channel`, ``cause.json``): one
``GET /apis/batch/v1/namespaces/NS/jobs/NAME`` per ask. That needs ``get`` on ``jobs``
(:func:`cairn.k8s.rbac.job_reader_rbac`); without it, or when the API cannot be reached, the
answer is "not suspended" with the reason, and the try ends ``preempted``.

:func:`request_job` is the one way the sidecar talks to its Job: the ask's ``GET`` here, and
the committed seqs the Job's annotation keeps (:mod:`cairn.k8s.committed`: read once before
the main container starts, merge-patched after commits).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from cairn.exceptions import ConfigError
from cairn.k8s.watchers import SERVICE_ACCOUNT_DIR
from cairn.runtime import channel

log = logging.getLogger("cairn.sidecar")

ASK_POLL_S = 0.1  # how often the sidecar looks for the supervisor's ask (one stat)
#: The content type of a JSON merge patch (RFC 7386), which the API server applies to a Job.
MERGE_PATCH = "application/merge-patch+json"


class OwnerKind(enum.Enum):
    """What keeps a pod's committed seqs (:mod:`cairn.k8s.committed`): its owner Job, which
    outlives its pods, or the pod itself, for a bare pod whose creator carries the seqs to the
    next pod it creates (the Airflow pod operator, through its task state store)."""

    JOB = "Job"
    POD = "Pod"

    @property
    def option(self) -> str:
        return "--owner-job" if self is OwnerKind.JOB else "--owner-pod"


@dataclass(frozen=True)
class JobSettings:
    """The pod's owner Job (or, ``kind`` POD, the pod itself) and how to reach the API
    server."""

    namespace: str
    name: str
    api_url: str
    token_file: str = os.path.join(SERVICE_ACCOUNT_DIR, "token")
    ca_file: str | None = os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt")
    timeout_s: float = 5.0
    kind: OwnerKind = OwnerKind.JOB

    def __post_init__(self) -> None:
        if not self.namespace or not self.name or "/" in self.name:
            raise ConfigError(f"{self.kind.option} {self.namespace}/{self.name}: give "
                              f"NAMESPACE/{self.kind.value.upper()} (with_snapshot_sidecar sets "
                              "it from the downward API)")
        if not self.api_url.startswith(("http://", "https://")):
            raise ConfigError(f"Kubernetes API URL {self.api_url!r} must start with https:// "
                              "(or http://)")

    @property
    def describe(self) -> str:
        """``Job NAMESPACE/NAME`` (or ``Pod ...``), for messages."""
        return f"{self.kind.value} {self.namespace}/{self.name}"

    @classmethod
    def parse(cls, owner: str, *, api_url: str | None, kind: OwnerKind = OwnerKind.JOB,
              **kw: str) -> JobSettings:
        """``NAMESPACE/NAME``; the API server from ``api_url`` or in-cluster
        (``KUBERNETES_SERVICE_HOST``/``_PORT``)."""
        namespace, _, name = owner.partition("/")
        if api_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ConfigError(f"{kind.option} runs in a pod (KUBERNETES_SERVICE_HOST is "
                                  "unset); elsewhere pass --kube-api URL")
            api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(namespace=namespace, name=name, api_url=api_url, kind=kind,
                   **kw)  # type: ignore[arg-type]


def job_url(settings: JobSettings) -> str:
    """The object's URL: the Job (``batch/v1``), or the pod (``v1``)."""
    group, plural = (("apis/batch/v1", "jobs") if settings.kind is OwnerKind.JOB
                     else ("api/v1", "pods"))
    return (f"{settings.api_url.rstrip('/')}/{group}/namespaces/"
            f"{urllib.parse.quote(settings.namespace, safe='')}/{plural}/"
            f"{urllib.parse.quote(settings.name, safe='')}")


def request_job(settings: JobSettings, *, merge_patch: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The Job (or pod) as the API server answers ``GET`` (or, given ``merge_patch``, a
    ``PATCH`` with that JSON merge patch, RFC 7386): the object after the request. One
    request, bounded by ``settings.timeout_s``, with the service account's token (re-read each
    time: projected tokens rotate). Raises :class:`urllib.error.HTTPError` for an answer that
    is not 2xx, :class:`OSError` when the server cannot be reached, :class:`ValueError` for a
    body that is not a JSON object."""
    context = None
    url = job_url(settings)
    if url.startswith("https://"):
        ca = settings.ca_file if settings.ca_file and os.path.exists(settings.ca_file) else None
        context = ssl.create_default_context(cafile=ca)
    with open(settings.token_file) as f:
        token = f.read().strip()
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    data = None
    if merge_patch is not None:
        headers["Content-Type"] = MERGE_PATCH
        data = json.dumps(merge_patch).encode()
    request = urllib.request.Request(url, data=data, headers=headers,
                                     method="GET" if data is None else "PATCH")
    with urllib.request.urlopen(request, timeout=settings.timeout_s, context=context) as r:
        doc = json.load(r)
    if not isinstance(doc, dict):
        raise ValueError(f"the API server answered {type(doc).__name__}, not a "
                         f"{settings.kind.value}")
    return doc


def check_job(settings: JobSettings) -> channel.Cause:
    """Whether the Job is suspended, as a :class:`~cairn.runtime.channel.Cause` (not
    ``asked_at``-stamped); never raises: a failure is "not suspended" with its reason."""
    job = f"Job {settings.namespace}/{settings.name}"
    try:
        doc = request_job(settings)
    except urllib.error.HTTPError as e:
        hint = (": grant the pod's service account get on jobs (cairn.k8s.job_reader_rbac, "
                "docs/kubernetes.md)" if e.code in (401, 403) else "")
        return _cause(False, f"cannot read {job}: the API server answered {e.code}{hint}; "
                             "taken as a preemption")
    except (OSError, ValueError) as e:
        return _cause(False, f"cannot read {job} ({e}); taken as a preemption")
    suspend = (doc.get("spec") or {}).get("suspend")
    if suspend is True:
        return _cause(True, f"{job} has spec.suspend: true (evicted by Kueue, or suspended)")
    return _cause(False, f"{job} is not suspended (spec.suspend: {json.dumps(suspend)}): a "
                         "node drain or preemption")


def _cause(suspended: bool, reason: str) -> channel.Cause:
    return channel.Cause(suspended=suspended, reason=reason, checked_at=time.time())


class CauseResponder(threading.Thread):
    """Says at start that it answers (an unstamped ``cause.json``), then answers each ask the
    supervisor writes (``terminating.json``) with :func:`check_job`."""

    def __init__(self, settings: JobSettings, shared_dir: str) -> None:
        super().__init__(name=f"job {settings.namespace}/{settings.name}", daemon=True)
        self.settings, self.shared_dir = settings, shared_dir
        self.stopping = threading.Event()
        self.answered: float | None = None
        self.healthy = True

    def announce(self) -> None:
        channel.write_cause(self.shared_dir, channel.Cause(
            suspended=False, reason="not asked yet", asked_at=None, checked_at=time.time()))

    def answer_once(self) -> channel.Cause | None:
        """Answer a new ask, if there is one; the answer written."""
        try:
            asked = channel.read_ask(self.shared_dir)
        except ConfigError as e:
            log.warning("%s", e)
            return None
        if asked is None or asked == self.answered:
            return None
        cause = check_job(self.settings)
        cause = channel.Cause(suspended=cause.suspended, reason=cause.reason, asked_at=asked,
                              checked_at=cause.checked_at)
        channel.write_cause(self.shared_dir, cause)
        self.answered = asked
        (log.warning if cause.suspended else log.error)(
            "the main container is stopping: %s", cause.reason)
        return cause

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.answer_once()
                self.healthy = True
            except OSError as e:
                if self.healthy:
                    log.error("cannot answer the supervisor's ask: %s", e)
                self.healthy = False
            self.stopping.wait(ASK_POLL_S)

    def stop(self) -> None:
        self.stopping.set()
