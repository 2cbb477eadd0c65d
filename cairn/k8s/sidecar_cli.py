"""The ``cairn sidecar`` subcommand's arguments (imported by ``cairn.cli.main``; stdlib only)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cairn.exceptions import ConfigError

EPILOG = """The sidecar never checkpoints: it tells the supervisor (`cairn run --notice-file`)
through DIR/notice.json and serves DIR/status.json as metrics. With --upload it commits the dumps
`cairn run --spool DIR/spool` hands it, and on SIGTERM keeps uploading until the spool is empty
or --sigterm-window runs out. --watch-node-label needs a service account bound to a ClusterRole
with get on nodes, and NODE_NAME from the downward API; --owner-job a Role with get and patch
on jobs (docs/kubernetes.md): with the committed-seq directory set in the environment (a Job
pod), the sidecar copies the seqs the Job's annotation keeps into it before /startedz answers
200, and keeps the annotation up with the commits recorded there. --owner-pod does the same
with the pod's own annotation (a bare pod whose creator carries it to the next pod: the
Airflow pod operator), and needs get and patch on pods. Exit codes: 0 stopped by
SIGTERM/SIGINT, 2 bad usage."""


def add_sidecar_parser(sub: Any) -> None:
    help_text = ("Kubernetes sidecar: watch for preemption notices, hand them to `cairn run`, "
                 "serve /readyz and Prometheus /metrics.")
    p = sub.add_parser("sidecar", help=help_text, description=help_text, epilog=EPILOG)
    p.add_argument("--shared", required=True, metavar="DIR",
                   help="the volume shared with the main container")
    p.add_argument("--port", type=int, default=9464, help="metrics/readiness port (default 9464)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument("--metadata-url", default=None, metavar="URL",
                   help="GCE metadata server (default $GCE_METADATA_HOST or "
                        "http://metadata.google.internal)")
    p.add_argument("--no-metadata", action="store_true",
                   help="do not watch the metadata server (not on GCE)")
    p.add_argument("--preemption-window", default="15s", metavar="DURATION",
                   help="time a pod has after instance/preempted turns TRUE (GKE spot: 15s)")
    p.add_argument("--watch-node-label", action="store_true",
                   help="watch this node's cloud.google.com/scheduled-maintenance-time label")
    p.add_argument("--node-name", default=None, help="default $NODE_NAME")
    p.add_argument("--kube-api", default=None, metavar="URL",
                   help="API server (default: in-cluster from KUBERNETES_SERVICE_HOST)")
    p.add_argument("--kube-token-file", default=None, metavar="PATH",
                   help="bearer token (default: the pod's service account token)")
    p.add_argument("--label-interval", default="60s", metavar="DURATION",
                   help="how often to read the node (default 60s)")
    p.add_argument("--maintenance-lead", default="10m", metavar="DURATION",
                   help="notify this long before the labelled maintenance time (default 10m)")
    p.add_argument("--sigterm-window", default="30s", metavar="DURATION",
                   help="deadline a notice from this container's SIGTERM carries (default 30s)")
    p.add_argument("--owner-job", default=None, metavar="NAMESPACE/JOB",
                   help="answer the supervisor's SIGTERM with whether this Job is suspended "
                        "(Kueue eviction → suspended, else preempted), and keep the committed "
                        "seqs in its annotation; needs get and patch on jobs")
    p.add_argument("--owner-pod", default=None, metavar="NAMESPACE/POD",
                   help="keep the committed seqs in this pod's own annotation (a bare pod, "
                        "not with --owner-job); needs get and patch on pods")
    p.add_argument("--upload", action="store_true",
                   help="commit the snapshots `cairn run --spool` hands over (process mode)")
    p.add_argument("--spool", default=None, metavar="DIR",
                   help="the spool to upload from (default SHARED/spool)")
    p.add_argument("--store", dest="upload_store", default=None, metavar="URL",
                   help="the store to upload to (default: the one each spooled ticket names)")
    p.add_argument("--key", dest="upload_key", default=None, metavar="KEY",
                   help="refuse spooled snapshots of any other key")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    p.set_defaults(func=cmd_sidecar, store=None)


def _settings(args: argparse.Namespace) -> Any:
    from cairn.k8s.sidecar import SidecarSettings
    from cairn.k8s.uploader import UploadSettings
    from cairn.k8s.watchers import MetadataSettings, NodeSettings, metadata_url_from_env
    from cairn.runtime.durations import parse_duration

    metadata = None
    if not args.no_metadata:
        metadata = MetadataSettings(base_url=args.metadata_url or metadata_url_from_env(),
                                    preemption_window_s=parse_duration(args.preemption_window))
    node = None
    if args.watch_node_label:
        extra: dict[str, Any] = {"interval_s": parse_duration(args.label_interval),
                                 "lead_s": parse_duration(args.maintenance_lead)}
        if args.kube_token_file:
            extra["token_file"] = args.kube_token_file
        if args.kube_api:
            node = NodeSettings(node_name=args.node_name or os.environ.get("NODE_NAME", ""),
                                api_url=args.kube_api, **extra)
        else:
            node = NodeSettings.in_cluster(node_name=args.node_name, **extra)
    upload = None
    if args.upload:
        upload = UploadSettings(spool_dir=args.spool or os.path.join(args.shared, "spool"),
                                store=args.upload_store, key=args.upload_key)
    elif args.spool or args.upload_store or args.upload_key:
        raise ConfigError("--spool, --store and --key go with --upload")
    job = pod = None
    if args.owner_job and args.owner_pod:
        raise ConfigError("--owner-job and --owner-pod: give one (a Job's pods keep the seqs "
                          "in the Job's annotation)")
    if args.owner_job or args.owner_pod:
        from cairn.k8s.jobs import JobSettings, OwnerKind

        token = {"token_file": args.kube_token_file} if args.kube_token_file else {}
        if args.owner_job:
            job = JobSettings.parse(args.owner_job, api_url=args.kube_api, **token)
        else:
            pod = JobSettings.parse(args.owner_pod, api_url=args.kube_api,
                                    kind=OwnerKind.POD, **token)
    from cairn.runtime.env import COMMITTED_DIR

    # Only where it is set (in a Job pod, to the shared volume): the default is this
    # container's own, which the main container never sees.
    committed_dir = os.environ.get(COMMITTED_DIR.name) or None
    return SidecarSettings(shared_dir=args.shared, port=args.port, host=args.host,
                           metadata=metadata, node=node, job=job, pod=pod,
                           committed_dir=None if committed_dir is None
                           else os.path.expanduser(committed_dir),
                           sigterm_window_s=parse_duration(args.sigterm_window), upload=upload)


def cmd_sidecar(args: argparse.Namespace) -> int:
    from cairn.k8s.sidecar import run

    try:
        settings = _settings(args)
    except ConfigError as e:
        print(f"cairn sidecar: error: {e}", file=sys.stderr)
        return 2
    return run(settings)
