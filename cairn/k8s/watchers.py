"""Preemption watchers for the sidecar: the GCE metadata server and the node's maintenance label.

Each watcher is a daemon thread that calls ``on_notice`` with a :class:`~cairn.runtime.channel.Notice`
when it learns that the node is going away, and never raises out of its thread: a watcher that
cannot reach its source (not on GCE, no RBAC) logs that once, backs off and keeps trying.

* :class:`MetadataWatcher` long-polls ``instance/preempted`` (``TRUE`` when a spot or
  preemptible VM is being reclaimed; the VM gets about 30 s, and GKE's graceful node shutdown
  gives pods a part of it) and ``instance/maintenance-event`` (changes about 60 s before a host
  maintenance event; GPU VMs cannot live-migrate, so a ``TERMINATE_ON_HOST_MAINTENANCE`` value
  means the node stops). Both with ``?wait_for_change=true`` and the ``Metadata-Flavor: Google``
  header, passing the last ``ETag`` back so no change is missed between two polls.
* :class:`NodeLabelWatcher` reads its own Node object through the Kubernetes API every
  ``interval`` seconds and watches ``cloud.google.com/scheduled-maintenance-time`` (set by GKE
  on GPU/TPU nodes ahead of a scheduled maintenance; a Unix time). It needs ``get`` on
  ``nodes`` (a ClusterRole; see docs/kubernetes.md) — polling, not a watch, because the label is
  set hours ahead and a plain GET needs the smallest grant.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from cairn.exceptions import ConfigError
from cairn.policy.options import MAINTENANCE_LABEL
from cairn.runtime.channel import Notice

log = logging.getLogger("cairn.sidecar")

DEFAULT_METADATA_URL = "http://metadata.google.internal"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_BACKOFF_MAX_S = 30.0

NoticeSink = Callable[[Notice], None]


def metadata_url_from_env() -> str:
    """The metadata server's base URL: ``$GCE_METADATA_HOST`` (as Google's client libraries
    read it) or ``http://metadata.google.internal``."""
    host = os.environ.get("GCE_METADATA_HOST")
    if not host:
        return DEFAULT_METADATA_URL
    return host if "://" in host else f"http://{host}"


class _Watcher(threading.Thread):
    """A daemon thread with a stop event and a logged, bounded back-off."""

    def __init__(self, name: str, on_notice: NoticeSink) -> None:
        super().__init__(name=name, daemon=True)
        self.on_notice = on_notice
        self.stopping = threading.Event()
        self.healthy = False  # the last poll reached its source
        self._failures = 0

    def stop(self) -> None:
        self.stopping.set()

    def _failed(self, what: str, error: BaseException) -> None:
        self.healthy = False
        self._failures += 1
        if self._failures == 1:
            log.warning("%s: %s (retrying with back-off; logged once)", what, error)
        self.stopping.wait(min(_BACKOFF_MAX_S, 0.5 * 2 ** min(self._failures, 6)))

    def _ok(self) -> None:
        if self._failures:
            log.warning("%s: reachable again", self.name)
        self.healthy, self._failures = True, 0


@dataclass(frozen=True)
class MetadataSettings:
    base_url: str = DEFAULT_METADATA_URL
    preemption_window_s: float = 15.0  # GKE spot: what a pod gets of the VM's 30 s
    maintenance_window_s: float = 60.0  # maintenance-event changes about 60 s ahead
    poll_timeout_s: float = 60.0  # the server answers a wait_for_change at the latest then

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--metadata-url {self.base_url!r} must start with http:// or "
                              "https://")
        if min(self.preemption_window_s, self.maintenance_window_s, self.poll_timeout_s) <= 0:
            raise ConfigError("metadata windows and timeouts must be positive")


class MetadataWatcher(_Watcher):
    """Long-polls one metadata key; ``decide(value)`` returns a notice reason or None."""

    def __init__(self, settings: MetadataSettings, key: str, on_notice: NoticeSink) -> None:
        super().__init__(f"metadata {key}", on_notice)
        if key not in ("preempted", "maintenance-event"):
            raise ConfigError(f"unknown metadata key {key!r}")
        self.settings = settings
        self.key = key
        self.last_value: str | None = None

    def _get(self, etag: str | None) -> tuple[str, str | None]:
        query = {"wait_for_change": "true",
                 "timeout_sec": str(int(self.settings.poll_timeout_s))}
        if etag:
            query["last_etag"] = etag
        url = (f"{self.settings.base_url.rstrip('/')}/computeMetadata/v1/instance/{self.key}?"
               + urllib.parse.urlencode(query))
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=self.settings.poll_timeout_s + 10) as resp:
            if resp.headers.get("Metadata-Flavor") != "Google":
                raise ConfigError(f"{self.settings.base_url} is not a GCE metadata server (no "
                                  "Metadata-Flavor: Google in its answer)")
            return resp.read().decode().strip(), resp.headers.get("ETag")

    def _notice_for(self, value: str) -> Notice | None:
        now = time.time()
        if self.key == "preempted":
            if value.upper() != "TRUE":
                return None
            return Notice(source="gce-preempted", reason="instance/preempted is TRUE",
                          issued_at=now, deadline=now + self.settings.preemption_window_s)
        if "TERMINATE" not in value.upper():
            if value.upper() not in ("NONE", ""):
                log.warning("instance/maintenance-event is %s: the VM stays up; no notice",
                            value)
            return None
        return Notice(source="gce-maintenance", reason=f"instance/maintenance-event is {value}",
                      issued_at=now, deadline=now + self.settings.maintenance_window_s)

    def run(self) -> None:
        etag: str | None = None
        while not self.stopping.is_set():
            try:
                value, etag = self._get(etag)
            except (OSError, ConfigError, urllib.error.URLError) as e:
                etag = None
                self._failed(f"metadata {self.key}", e)
                continue
            self._ok()
            if value != self.last_value:
                self.last_value = value
                notice = self._notice_for(value)
                if notice is not None:
                    self.on_notice(notice)


@dataclass(frozen=True)
class NodeSettings:
    node_name: str
    api_url: str
    token_file: str = os.path.join(SERVICE_ACCOUNT_DIR, "token")
    ca_file: str | None = os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt")
    interval_s: float = 60.0
    lead_s: float = 600.0  # issue the notice this long before the maintenance starts

    def __post_init__(self) -> None:
        if not self.node_name:
            raise ConfigError("--watch-node-label needs the node's name: set NODE_NAME from the "
                              "downward API (fieldRef spec.nodeName) or pass --node-name")
        if not self.api_url.startswith(("http://", "https://")):
            raise ConfigError(f"Kubernetes API URL {self.api_url!r} must start with https:// "
                              "(or http://)")
        if self.interval_s <= 0 or self.lead_s < 0:
            raise ConfigError("the node-label poll interval must be positive and the lead "
                              "zero or more")

    @classmethod
    def in_cluster(cls, *, node_name: str | None = None, **kw: float) -> NodeSettings:
        """From the pod's environment: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and ``NODE_NAME``."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError("--watch-node-label runs in a pod (KUBERNETES_SERVICE_HOST is "
                              "unset); elsewhere pass --kube-api URL")
        if ":" in host:
            host = f"[{host}]"
        return cls(node_name=node_name or os.environ.get("NODE_NAME", ""),
                   api_url=f"https://{host}:{port}", **kw)  # type: ignore[arg-type]


def parse_maintenance_time(value: str) -> float:
    """The label's value as a Unix time: an integer of seconds, or an RFC 3339 time."""
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{MAINTENANCE_LABEL}={value!r} is neither a Unix time nor RFC 3339") \
            from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


class NodeLabelWatcher(_Watcher):
    """Polls the node; a notice once the maintenance label's time is within ``lead_s``."""

    def __init__(self, settings: NodeSettings, on_notice: NoticeSink) -> None:
        super().__init__(f"node {settings.node_name} label", on_notice)
        self.settings = settings
        self.announced: float | None = None  # the maintenance time already noticed
        context = None
        if settings.api_url.startswith("https://"):
            ca = settings.ca_file if settings.ca_file and os.path.exists(settings.ca_file) else None
            context = ssl.create_default_context(cafile=ca)
        self._context = context

    def _labels(self) -> dict[str, str]:
        with open(self.settings.token_file) as f:
            token = f.read().strip()  # re-read: projected tokens rotate
        url = (f"{self.settings.api_url.rstrip('/')}/api/v1/nodes/"
               f"{urllib.parse.quote(self.settings.node_name, safe='')}")
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                                       "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30, context=self._context) as resp:
                node = json.load(resp)
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise ConfigError(f"the API server answered {e.code} for GET {url}: bind the "
                                  "pod's service account to a ClusterRole with get on nodes "
                                  "(docs/kubernetes.md)") from None
            raise
        labels = (node.get("metadata") or {}).get("labels") or {}
        return {str(k): str(v) for k, v in labels.items()}

    def check_once(self) -> Notice | None:
        """One poll: the notice to issue now, if any (raises on an unreachable API)."""
        value = self._labels().get(MAINTENANCE_LABEL)
        if value is None:
            return None
        when = parse_maintenance_time(value)
        now = time.time()
        if when == self.announced or when - now > self.settings.lead_s:
            return None
        self.announced = when
        return Notice(source="node-label", reason=f"{MAINTENANCE_LABEL}={value}",
                      issued_at=now, deadline=when)

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                notice = self.check_once()
            except (OSError, ConfigError, ValueError, urllib.error.URLError) as e:
                self._failed(self.name, e)
                continue
            self._ok()
            if notice is not None:
                self.on_notice(notice)
            self.stopping.wait(self.settings.interval_s)
