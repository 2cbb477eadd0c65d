"""What a finished pod says: the image digest it ran, its main container's exit code, whether
the node or the kernel ended it, the cairn error and the outcome that stands for, and the
outcome record ``cairn run`` could not write for it. Reads pods as the Kubernetes client returns
them (snake_case objects) or as JSON (camelCase dicts); no Airflow imports."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from cairn.exceptions import ConfigError

# Pod-level signs that the node, not the step, ended the pod (graceful node shutdown, eviction).
NODE_ENDED_REASONS = frozenset({"Shutdown", "NodeShutdown", "Terminated", "Evicted",
                                "Preempting", "NodeLost"})
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def image_repository(image: str) -> str:
    """``image`` without its tag or digest (a registry port is kept)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        last[-1] = last[-1].split(":", 1)[0]
    return "/".join(last)


def digest_of(image_id: str | None) -> str | None:
    """The ``sha256:...`` repository digest in a container status' ``imageID``
    (``repo@sha256:...``, ``docker-pullable://repo@sha256:...``); None when it holds none
    (a bare ``sha256:...`` is a local image ID, not something a registry can serve)."""
    if not image_id or "@" not in image_id:
        return None
    digest = image_id.rsplit("@", 1)[1]
    return digest if _DIGEST.fullmatch(digest) else None


def pin_image(image: str, digest: str) -> str:
    """``image`` pinned to ``digest``: ``repository@sha256:...``."""
    if not _DIGEST.fullmatch(digest or ""):
        raise ConfigError(f"{digest!r} is not an image digest (sha256: and 64 hex digits)")
    return f"{image_repository(image)}@{digest}"


def _field(obj: Any, snake: str, camel: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(camel, obj.get(snake))
    return getattr(obj, snake, None)


def _container_status(pod: Any, container: str) -> Any:
    status = _field(pod, "status", "status")
    for s in _field(status, "container_statuses", "containerStatuses") or []:
        if _field(s, "name", "name") == container:
            return s
    return None


def image_digest_from_pod(pod: Any, container: str) -> str | None:
    """The digest the node pulled for ``container`` (from ``status.containerStatuses``), if any.
    Takes a ``V1Pod`` or a manifest dict."""
    return digest_of(_field(_container_status(pod, container), "image_id", "imageID"))


def exit_code_of(pod: Any, container: str) -> int | None:
    """``container``'s exit code, from its current or last terminated state."""
    s = _container_status(pod, container)
    for state_name in (("state", "state"), ("last_state", "lastState")):
        terminated = _field(_field(s, *state_name), "terminated", "terminated")
        code = _field(terminated, "exit_code", "exitCode")
        if code is not None:
            return int(code)
    return None


def _disruption_reason(pod: Any) -> str | None:
    status = _field(pod, "status", "status")
    for c in _field(status, "conditions", "conditions") or []:
        if _field(c, "type", "type") == "DisruptionTarget" and \
                str(_field(c, "status", "status")) == "True":
            return str(_field(c, "reason", "reason") or "DisruptionTarget")
    return None


def ended_by_node(pod: Any) -> bool:
    """Whether the pod's status says the node or the cluster ended it (graceful node shutdown,
    eviction, a ``DisruptionTarget`` condition), rather than the step's own failure."""
    status = _field(pod, "status", "status")
    return _field(status, "reason", "reason") in NODE_ENDED_REASONS or \
        _disruption_reason(pod) is not None


def _oom_killed(pod: Any, container: str) -> bool:
    terminated = _field(_field(_container_status(pod, container), "state", "state"),
                        "terminated", "terminated")
    return _field(terminated, "reason", "reason") == "OOMKilled"


def outcome_from_pod(pod: Any, container: str) -> Any:
    """How a pod that ``cairn run`` could not report on ended, as an
    :class:`~cairn.store.outcomes.OutcomeKind`: ``failed`` for OOMKilled (the step's error),
    ``evicted`` for a drain (eviction API, pod GC, node-pressure eviction), ``preempted`` for a
    node shutdown or scheduler preemption; None when the container's own exit code says it
    (cairn's codes are recorded by ``cairn run`` itself) or nothing is known."""
    from cairn.runtime.session import conclude, end_of_pod

    reason = _disruption_reason(pod)
    pod_reason = _field(_field(pod, "status", "status"), "reason", "reason")
    end = end_of_pod(
        oom_killed=_oom_killed(pod, container),
        drained=reason in ("EvictionByEvictionAPI", "DeletionByPodGC") or pod_reason == "Evicted",
        node_ended=reason is not None or pod_reason in NODE_ENDED_REASONS)
    return None if end is None else conclude(end).outcome


def pod_end_error(pod: Any, container: str) -> Exception | None:
    """The cairn error a finished pod stands for: the one its exit code stands for
    (:func:`cairn.runtime.exits.error_for_exit`), else :class:`Preempted` for a pod the node
    ended, None otherwise (success, or the step's own failure, OOMKilled included, which
    Airflow reports as it does for any pod)."""
    from cairn.exceptions import Preempted
    from cairn.runtime.exits import error_for_exit

    code = exit_code_of(pod, container)
    error = error_for_exit(code, where="cairn run in the pod") if code is not None else None
    if error is not None:
        return error
    if not _oom_killed(pod, container) and ended_by_node(pod):
        return Preempted("the node ended the pod (shutdown, eviction or disruption); a retry "
                         "resumes from the last committed snapshot")
    return None


def _timestamp(value: Any) -> float | None:
    """A pod's time, as the client gives it (a datetime) or as JSON (RFC 3339), in seconds
    since the Unix epoch; None when it is neither."""
    from cairn.store import parse_timestamp  # here: DAG files import this module

    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return parse_timestamp(value)
        except ValueError:
            return None
    return None


def record_pod_outcome(store: Any, key: Any, pod: Any, container: str, *,
                       placement: Any = None) -> Any:
    """Leave the outcome record ``cairn run`` could not write for a pod that the node or the
    kernel ended (see :func:`outcome_from_pod`): for the newest try of ``key`` that opened after
    the pod started and has no record. Returns the :class:`Outcome` written, or None."""
    from cairn.runtime.endings import record_observed

    kind = outcome_from_pod(pod, container)
    status = _field(pod, "status", "status")
    started = _timestamp(_field(status, "start_time", "startTime"))
    if kind is None or started is None:
        return None
    recorded = {o.epoch for o in store.records.outcomes(key)}
    open_tries = [t for t in store.records.tries(key)
                  if t.epoch not in recorded and t.done_at is None and t.opened_at >= started]
    if not open_tries:
        return None
    last = open_tries[-1]
    detail = {"source": "pod status", "pod_reason": _field(status, "reason", "reason"),
              "disruption": _disruption_reason(pod), "exit_code": exit_code_of(pod, container)}
    return record_observed(
        store, key, epoch=last.epoch, kind=kind, started_at=last.opened_at,
        option=placement.option.name if placement is not None else None,
        reason=placement.reason if placement is not None else None,
        options=placement.options if placement is not None else (),
        detail={k: v for k, v in detail.items() if v is not None})
