"""Fakes for what cannot run on these machines: a GCE metadata server and a Kubernetes API
server, each a small ``http.server`` on 127.0.0.1. Named fakes on purpose: they implement only
what cairn's watchers and its Job annotation use, as documented by Google and Kubernetes."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that went away mid long-poll (a stopped sidecar) is normal here.
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@dataclass
class Request:
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    method: str = "GET"
    body: bytes = b""


@dataclass
class FakeMetadataServer:
    """``/computeMetadata/v1/instance/{preempted,maintenance-event}`` with the real contract:
    ``Metadata-Flavor: Google`` required (403 otherwise) and echoed; an ``ETag`` per value;
    ``?wait_for_change=true`` blocks until the value's ETag differs from ``last_etag`` (or
    ``timeout_sec`` passes) and answers at once when ``last_etag`` is stale or absent..."""

    values: dict[str, str] = field(default_factory=lambda: {
        "preempted": "FALSE", "maintenance-event": "NONE"})
    requests: list[Request] = field(default_factory=list)
    flavor_header: bool = True  # False: behave like a server that is not a metadata server
    url: str = ""
    closed: bool = False
    _changed: threading.Condition = field(default_factory=threading.Condition)

    @staticmethod
    def etag(value: str) -> str:
        return hashlib.sha256(value.encode()).hexdigest()[:16]

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self.values[key] = value
            self._changed.notify_all()

    def waiting(self, key: str) -> int:
        """How many long-polls for ``key`` came with the current value's ETag (the watcher has
        seen the current value and is waiting for a change)."""
        current = self.etag(self.values[key])
        return sum(1 for r in list(self.requests) if r.path.endswith("/" + key)
                   and r.query.get("last_etag") == current)

    def answer(self, path: str, query: dict[str, str], headers: dict[str, str]) -> tuple[int, str, str]:
        self.requests.append(Request(path, query, headers))
        if headers.get("metadata-flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header.", ""
        prefix = "/computeMetadata/v1/instance/"
        key = path[len(prefix):] if path.startswith(prefix) else ""
        if key not in self.values:
            return 404, "not found", ""
        with self._changed:
            if query.get("wait_for_change") == "true":
                timeout = float(query.get("timeout_sec", "60"))
                last = query.get("last_etag")
                if last is not None:
                    self._changed.wait_for(lambda: self.closed or
                                           self.etag(self.values[key]) != last,
                                           timeout=min(timeout, 60))
            value = self.values[key]
        return 200, value, self.etag(value)


# The Job the integration tests' fake API serves (the ``fake_api`` fixture): namespace, name.
JOB = ("ml", "train")


@dataclass
class FakeKubernetesAPI:
    """``GET /api/v1/nodes/{name}`` and ``GET /apis/batch/v1/namespaces/{ns}/jobs/{name}`` with
    bearer-token auth (401 without, 403 for another token, or for a resource in
    ``forbidden``: a service account without that RBAC grant; ``"jobs/patch"`` forbids only
    the patch), answering the Node's metadata or the Job's ``spec.suspend``, ``annotations``
    and ``resourceVersion``. Labels are changed with :meth:`label`, Jobs through ``jobs``
    (``(namespace, name) -> suspend``) and ``annotations``.

    ``PATCH`` of a Job takes a JSON merge patch (RFC 7386; 415 for another content type) of
    ``metadata.annotations`` only (422 for anything else, which cairn never patches), with the
    API server's optimistic concurrency: a ``metadata.resourceVersion`` in the patch that is
    not the Job's current one is a 409 Conflict; each change bumps the version. A Job ``GET``
    waits while ``reads_open`` is clear (a slow API server).

    Pods (``/api/v1/namespaces/{ns}/pods/{name}``: a bare pod that keeps its own annotation)
    are served alike from ``pods``, ``pod_annotations`` and ``pod_versions``; ``"pods"`` and
    ``"pods/patch"`` in ``forbidden`` deny them."""

    token: str = "fake-token"
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    jobs: dict[tuple[str, str], bool] = field(default_factory=dict)
    annotations: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    versions: dict[tuple[str, str], int] = field(default_factory=dict)
    pods: set[tuple[str, str]] = field(default_factory=set)
    pod_annotations: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    pod_versions: dict[tuple[str, str], int] = field(default_factory=dict)
    forbidden: set[str] = field(default_factory=set)
    requests: list[Request] = field(default_factory=list)
    reads_open: threading.Event = field(default_factory=threading.Event)
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.reads_open.set()

    def job_document(self, ns: str, name: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "namespace": ns,
                                    "resourceVersion": str(self.versions.get((ns, name), 1))}
        if self.annotations.get((ns, name)):
            metadata["annotations"] = dict(self.annotations[(ns, name)])
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
                "spec": {"suspend": self.jobs[(ns, name)], "completionMode": "Indexed"}}

    def pod_document(self, ns: str, name: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "namespace": ns,
                                    "resourceVersion": str(self.pod_versions.get((ns, name), 1))}
        if self.pod_annotations.get((ns, name)):
            metadata["annotations"] = dict(self.pod_annotations[(ns, name)])
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {}}

    def touch(self, ns: str, name: str) -> None:
        """Another writer changed the Job (its status, another pod's patch): a new version."""
        self.versions[(ns, name)] = self.versions.get((ns, name), 1) + 1

    def _object(self, path: str) -> tuple[str, str, str] | None:
        """``("jobs" | "pods", namespace, name)`` of an object's path, else None."""
        found = re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/(jobs)/([^/]+)", path) or \
            re.fullmatch(r"/api/v1/namespaces/([^/]+)/(pods)/([^/]+)", path)
        if found is None:
            return None
        ns, plural, name = found.groups()
        return plural, urllib.parse.unquote(ns), urllib.parse.unquote(name)

    def _store(self, plural: str) -> tuple[Any, dict[tuple[str, str], dict[str, str]],
                                          dict[tuple[str, str], int]]:
        if plural == "jobs":
            return self.jobs, self.annotations, self.versions
        return self.pods, self.pod_annotations, self.pod_versions

    def _document(self, plural: str, ns: str, name: str) -> dict[str, Any]:
        return (self.job_document if plural == "jobs" else self.pod_document)(ns, name)

    @staticmethod
    def _forbidden_answer(plural: str, verb: str) -> tuple[int, str, str]:
        group = "jobs.batch" if plural == "jobs" else "pods"
        return 403, json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden",
                                "message": f'{group} is forbidden: User "system:'
                                f'serviceaccount:ml:default" cannot {verb} resource '
                                f'"{plural}"'}), ""

    def patches(self) -> list[Request]:
        return [r for r in list(self.requests) if r.method == "PATCH"]

    def _auth(self, headers: dict[str, str]) -> tuple[int, str, str] | None:
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            return 401, json.dumps({"kind": "Status", "code": 401, "reason": "Unauthorized"}), ""
        if auth != f"Bearer {self.token}":
            return 403, json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden"}), ""
        return None

    def answer_patch(self, path: str, query: dict[str, str], headers: dict[str, str],
                     body: bytes) -> tuple[int, str, str]:
        self.requests.append(Request(path, query, headers, "PATCH", body))
        denied = self._auth(headers)
        if denied is not None:
            return denied
        found = self._object(path)
        if found is None:
            return 405, json.dumps({"kind": "Status", "code": 405}), ""
        plural, ns, name = found
        if {plural, f"{plural}/patch"} & self.forbidden:
            return self._forbidden_answer(plural, "patch")
        if headers.get("content-type") != "application/merge-patch+json":
            return 415, json.dumps({"kind": "Status", "code": 415,
                                    "reason": "UnsupportedMediaType"}), ""
        objects, all_annotations, versions = self._store(plural)
        if (ns, name) not in objects:
            return 404, json.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}), ""
        try:
            patch = json.loads(body)
            metadata = patch["metadata"]
            changes = metadata.get("annotations", {})
            if set(patch) != {"metadata"} or set(metadata) - {"annotations", "resourceVersion"} \
                    or not isinstance(changes, dict):
                raise ValueError("the fake patches metadata.annotations only")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return 422, json.dumps({"kind": "Status", "code": 422, "message": str(e)}), ""
        with self._lock:  # one change at a time, as etcd's compare-and-swap
            current = str(versions.get((ns, name), 1))
            if "resourceVersion" in metadata and metadata["resourceVersion"] != current:
                return 409, json.dumps({"kind": "Status", "code": 409, "reason": "Conflict"}), ""
            annotations = all_annotations.setdefault((ns, name), {})
            for key, value in changes.items():  # RFC 7386: null removes, a string replaces
                if value is None:
                    annotations.pop(key, None)
                else:
                    annotations[key] = value
            versions[(ns, name)] = versions.get((ns, name), 1) + 1
            return 200, json.dumps(self._document(plural, ns, name)), ""

    def label(self, node: str, key: str, value: str | None) -> None:
        labels = self.nodes.setdefault(node, {})
        if value is None:
            labels.pop(key, None)
        else:
            labels[key] = value

    def answer(self, path: str, query: dict[str, str], headers: dict[str, str]) -> tuple[int, str, str]:
        self.requests.append(Request(path, query, headers))
        denied = self._auth(headers)
        if denied is not None:
            return denied
        found = self._object(path)
        if found is not None:
            plural, ns, name = found
            self.reads_open.wait(60)
            if plural in self.forbidden:
                return self._forbidden_answer(plural, "get")
            if (ns, name) not in self._store(plural)[0]:
                return 404, json.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}), ""
            return 200, json.dumps(self._document(plural, ns, name)), ""
        prefix = "/api/v1/nodes/"
        name = urllib.parse.unquote(path[len(prefix):]) if path.startswith(prefix) else ""
        if name not in self.nodes:
            return 404, json.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}), ""
        node: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": name, "labels": dict(self.nodes[name])}}
        return 200, json.dumps(node), ""


@contextmanager
def serve(fake: FakeMetadataServer | FakeKubernetesAPI) -> Iterator[str]:
    """Serve ``fake`` on 127.0.0.1 (a free port); yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            parts = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(parts.query))
            headers = {k.lower(): v for k, v in self.headers.items()}
            code, body, etag = fake.answer(parts.path, query, headers)
            self._reply(code, body, etag)

        def do_PATCH(self) -> None:  # noqa: N802
            parts = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(parts.query))
            headers = {k.lower(): v for k, v in self.headers.items()}
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if isinstance(fake, FakeKubernetesAPI):
                self._reply(*fake.answer_patch(parts.path, query, headers, data))
            else:
                self._reply(405, "method not allowed", "")

        def _reply(self, code: int, body: str, etag: str) -> None:
            data = body.encode()
            self.send_response(code)
            if isinstance(fake, FakeMetadataServer):
                if fake.flavor_header:
                    self.send_header("Metadata-Flavor", "Google")
                if etag:
                    self.send_header("ETag", etag)
                self.send_header("Content-Type", "application/text")
            else:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield fake.url
    finally:
        if isinstance(fake, FakeMetadataServer):
            with fake._changed:  # release blocked long-polls
                fake.closed = True
                fake._changed.notify_all()
        else:
            fake.reads_open.set()  # release held reads
        server.shutdown()
        server.server_close()
