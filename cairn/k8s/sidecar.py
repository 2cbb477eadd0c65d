"""``cairn sidecar``: the Kubernetes sidecar container's process. It never checkpoints.

It watches for preemption notices (the GCE metadata server, optionally the node's maintenance
label, its own SIGTERM), hands them to the supervisor in the main container through the notice
file on the shared volume (:mod:`cairn.runtime.channel`), and serves ``/readyz`` and ``/metrics``
from the status file the supervisor writes there. The supervisor decides, by its measured
snapshot cost and the notice's deadline, whether a final snapshot fits.

With ``--owner-job`` it answers the supervisor's SIGTERM with whether the pod's Job was suspended
(a Kueue eviction: the try ends ``suspended``) or not (a drain: ``preempted``); see
:mod:`cairn.k8s.jobs`.

With ``--upload`` it also commits the dumps the supervisor spools on that volume
(:mod:`cairn.k8s.uploader`), and on SIGTERM keeps uploading until the spool is empty or its
window (``--sigterm-window``) runs out.

With :data:`~cairn.runtime.env.COMMITTED_DIR` set (the committed-seq files on the shared
volume) it records the commits it uploads there, and with ``--owner-job`` (or, a bare pod,
``--owner-pod``) too copies the seqs the Job's (or the pod's own) annotation keeps into it
before ``/startedz`` answers 200, then keeps the annotation up with it
(:mod:`cairn.k8s.committed`).
"""

from __future__ import annotations

import http.server
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from cairn.exceptions import ConfigError
from cairn.k8s import metrics
from cairn.k8s.committed import STARTED_PATH, JobAnnotation, SharedMarks
from cairn.runtime import channel
from cairn.k8s.jobs import CauseResponder, JobSettings
from cairn.k8s.uploader import Uploader, UploadSettings
from cairn.k8s.watchers import MetadataSettings, MetadataWatcher, NodeLabelWatcher, NodeSettings
from cairn.runtime.env import COMMITTED_DIR
from cairn.runtime.wakeup import Wakeup

log = logging.getLogger("cairn.sidecar")


@dataclass(frozen=True)
class SidecarSettings:
    shared_dir: str
    port: int = 9464
    host: str = "0.0.0.0"
    metadata: MetadataSettings | None = MetadataSettings()  # None: not on GCE
    node: NodeSettings | None = None  # None: the maintenance label is not watched
    sigterm_window_s: float = 30.0  # the deadline a SIGTERM notice carries (the pod's grace)
    upload: UploadSettings | None = None  # None: the supervisor writes to the store itself
    job: JobSettings | None = None  # the owner Job whose spec.suspend tells Kueue from a drain
    # A bare pod itself (kind POD), whose annotation keeps the committed seqs for its creator.
    pod: JobSettings | None = None
    # The committed-seq files the pod's containers share (None: the sidecar records none, and
    # no annotation keeps them).
    committed_dir: str | None = None

    def __post_init__(self) -> None:
        if not os.path.isdir(self.shared_dir):
            raise ConfigError(f"--shared {self.shared_dir} is not a directory: mount the pod's "
                              "shared volume there (with_snapshot_sidecar does)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        if self.job is not None and self.pod is not None:
            raise ConfigError("a Job's pod keeps its committed seqs in the Job's annotation: "
                              "give the owner Job or the pod, not both")

    @property
    def keeper(self) -> JobSettings | None:
        """The object whose annotation keeps the committed seqs: the Job, or the bare pod."""
        return self.job if self.job is not None else self.pod

    @property
    def notice_path(self) -> str:
        return os.path.join(self.shared_dir, channel.NOTICE_NAME)

    @property
    def status_path(self) -> str:
        return os.path.join(self.shared_dir, channel.STATUS_NAME)


class Sidecar:
    """Construct, :meth:`start` (binds the port, starts the watchers), then :meth:`wait`."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.notices_sent: dict[str, int] = {}
        self._lock = threading.Lock()
        self._wake = Wakeup()
        self._signum: int | None = None
        self._stopping = False
        self.watchers: list[MetadataWatcher | NodeLabelWatcher] = []
        if settings.metadata is not None:
            for key in ("preempted", "maintenance-event"):
                self.watchers.append(MetadataWatcher(settings.metadata, key, self.notify))
        if settings.node is not None:
            self.watchers.append(NodeLabelWatcher(settings.node, self.notify))
        self._server: http.server.ThreadingHTTPServer | None = None
        self.responder = (CauseResponder(settings.job, settings.shared_dir)
                          if settings.job is not None else None)
        self.marks = (SharedMarks(settings.committed_dir)
                      if settings.committed_dir is not None else None)
        self.annotation = (JobAnnotation(settings.keeper, self.marks)
                           if settings.keeper is not None and self.marks is not None else None)
        self.uploader = (Uploader(settings.upload, on_commit=self.marks.record_commit
                                  if self.marks is not None else None)
                         if settings.upload is not None else None)
        self._started = False

    # -- notices ---------------------------------------------------------------------------

    def notify(self, notice: channel.Notice) -> None:
        """Publish ``notice`` unless a pending one already has an earlier deadline."""
        with self._lock:
            try:
                pending = channel.read_notice(self.settings.notice_path)
            except ConfigError as e:
                log.warning("replacing an unreadable notice: %s", e)
                pending = None
            if pending is not None and pending.deadline <= notice.deadline:
                log.warning("notice from %s (%s): one with an earlier deadline is pending",
                            notice.source, notice.reason)
                return
            channel.write_notice(self.settings.notice_path, notice)
            self.notices_sent[notice.source] = self.notices_sent.get(notice.source, 0) + 1
        log.warning("notice from %s: %s; %.1fs to the deadline", notice.source, notice.reason,
                    notice.seconds_left())

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        # Only record and wake: a handler that takes a lock can deadlock (cairn.runtime.wakeup).
        if self._signum is None:
            self._signum = signum
        self._wake.set()

    def _notice_sigterm(self, signum: int) -> None:
        # Native sidecars are stopped after the main containers, so the supervisor has usually
        # gone by now; the notice is for the case where it has not.
        now = time.time()
        try:
            self.notify(channel.Notice(source="sigterm", reason=signal.Signals(signum).name,
                                       issued_at=now,
                                       deadline=now + self.settings.sigterm_window_s))
        except OSError as e:
            log.error("cannot write the notice: %s", e)

    # -- HTTP ------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        if not os.access(self.settings.shared_dir, os.W_OK | os.X_OK):
            return False, f"cannot write to {self.settings.shared_dir}"
        return True, "ok"

    def started(self) -> tuple[bool, str]:
        """For the startup probe, which holds the main container back: done starting, and the
        committed seqs copied from the Job's (or pod's) annotation (or that gave up)."""
        if not self._started:
            return False, "starting"
        if self.annotation is not None and not self.annotation.seeded.is_set():
            return False, f"reading the committed seqs from {self.annotation.job}"
        return True, "ok"

    def metrics_page(self) -> str:
        try:
            status = channel.read_status(self.settings.status_path)
        except ConfigError as e:
            log.warning("%s", e)
            status = None
        return metrics.render(status, notices_sent=dict(self.notices_sent),
                              watchers_healthy={w.name: w.healthy for w in self.watchers},
                              uploads=None if self.uploader is None else self.uploader.stats)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        sidecar = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path in ("/readyz", "/healthz"):
                    ok, why = sidecar.ready()
                    self._send(200 if ok else 503, why + "\n", "text/plain; charset=utf-8")
                elif path == STARTED_PATH:
                    ok, why = sidecar.started()
                    self._send(200 if ok else 503, why + "\n", "text/plain; charset=utf-8")
                elif path == "/metrics":
                    self._send(200, sidecar.metrics_page(), metrics.CONTENT_TYPE)
                else:
                    self._send(404, "try /metrics or /readyz\n", "text/plain; charset=utf-8")

            def _send(self, code: int, body: str, content_type: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                log.debug("http: " + format, *args)

        return Handler

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    def start(self) -> None:
        if self.marks is not None:
            self.marks.prepare()  # before the main container can start: the probe waits
        elif self.settings.keeper is not None:
            log.warning("no committed-seq directory (%s): the annotation of %s does not keep "
                        "the committed seqs (with_snapshot_sidecar sets it)", COMMITTED_DIR,
                        self.settings.keeper.describe)
        self._server = http.server.ThreadingHTTPServer((self.settings.host, self.settings.port),
                                                       self._handler())
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="cairn-sidecar-http",
                         daemon=True).start()
        for watcher in self.watchers:
            watcher.start()
        if self.uploader is not None:
            self.uploader.start()
        if self.responder is not None:
            self.responder.announce()
            self.responder.start()
        if self.annotation is not None:
            self.annotation.start()  # seeds first: /startedz answers 200 once it has
        self._started = True
        log.warning("watching %s; metrics on port %d; shared %s",
                    ", ".join(w.name for w in self.watchers) or "SIGTERM only", self.port,
                    self.settings.shared_dir)

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_sigterm)

    def wait(self) -> None:
        """Until SIGTERM/SIGINT (then its notice is published) or :meth:`stop`."""
        while self._signum is None and not self._stopping:
            self._wake.wait(1.0)
        if self._signum is not None:
            self._notice_sigterm(self._signum)

    def drain(self) -> None:
        """After SIGTERM: upload what is spooled while the window lasts (metrics stay up)."""
        if self.uploader is not None:
            self.uploader.drain(max(0.0, self.settings.sigterm_window_s - 1.0))

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for watcher in self.watchers:
            watcher.stop()
        if self.uploader is not None:
            self.uploader.stop()
        if self.responder is not None:
            self.responder.stop()
        if self.annotation is not None:
            self.annotation.stop()  # after the uploads: their commits are published too
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def run(settings: SidecarSettings) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code (0)."""
    sidecar = Sidecar(settings)
    sidecar.install_signal_handlers()
    sidecar.start()
    try:
        sidecar.wait()
        sidecar.drain()
    finally:
        sidecar.stop()
    log.warning("stopped")
    return 0
