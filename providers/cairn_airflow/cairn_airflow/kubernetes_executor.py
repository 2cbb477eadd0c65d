"""A ``pod_template_file`` for Airflow's KubernetesExecutor with cairn's pod transform applied.

::

    python -m cairn_airflow.kubernetes_executor BASE.yaml --sidecar-image REPO/cairn-sidecar:TAG \\
        --output pod_template.yaml

    # airflow.cfg
    [kubernetes_executor]
    pod_template_file = /opt/airflow/pod_templates/pod_template.yaml

Contract (docs/distributed-airflow.md, "KubernetesExecutor"; design: docs/adr/0033):

- the input is the administrator's own worker template, a Pod whose first container is named
  ``base`` (Airflow's convention: the executor merges each task's container into
  ``spec.containers[0]`` and names it ``base``); it is never modified;
- the output is that Pod with cairn's transform (:func:`cairn.k8s.with_snapshot_sidecar`) for the
  ``base`` container in state mode: the native cairn sidecar, the shared memory-backed volume,
  ``CAIRN_NOTICE_FILE`` and ``CAIRN_STATUS_FILE``, the grace, memory and the optional secret,
  node affinity and node-label watch. It carries **no key and no store**: one template serves
  every task, and under the KubernetesExecutor the executor replaces ``base``'s ``args`` with
  each task's own command; the cairn operators running in the pod set ``CAIRN_STORE`` and
  ``CAIRN_KEY`` per task instance (the key ``dag/task/run_id/map_index``, the store from the
  operator's ``store_url`` or the ``cairn`` connection), as they do on any worker;
- ``mode="process"`` also gives ``base`` the privileges ``cairn run`` needs for CRIU (ADR 0008:
  root, capabilities, seccomp and AppArmor unconfined; its own PID namespace, ADR 0007), for the
  tasks that run ``CairnRunOperator``; select it per task with
  ``executor_config={"pod_template_file": PATH}`` so other tasks' pods stay unprivileged.
  ``cairn run`` then uploads its own dumps (no spool: the sidecar cannot know the per-task key);
- the template is validated strict against ``kubernetes_version`` (1.29 or later) before it is
  returned; the tests also validate the pods Airflow builds from it;
- bad input raises :class:`~cairn.exceptions.ConfigError` naming the fix.

The YAML is deterministic (:func:`render_pod_template`): the same input writes the same bytes,
so a generated file can be checked in and a test can keep it up to date.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cairn.exceptions import ConfigError
from cairn.k8s import PodMode, coerce_option, grant_process_mode, with_snapshot_sidecar
from cairn.runtime import env

BASE_CONTAINER = "base"  # the KubernetesExecutor's name for the task's container
DEFAULT_KUBERNETES_VERSION = "1.29"
# Options of the transform that a template may set: the same for every task of the executor.
TEMPLATE_OPTIONS = frozenset({
    "final_snapshot_s", "grace_margin_s", "grace_cap_s", "state_bytes", "staging",
    "avoid_maintenance", "watch_node_label", "on_gce", "metrics_port", "image_pull_policy",
    "secret_name", "secret_key",
})
# Options a template must not set, and what to do instead.
PER_TASK_OPTIONS = {
    "store": "the store comes from each task's operator (store_url= or the cairn connection), "
             f"which sets {env.STORE.name} in the pod at run time",
    "key": "the key is per task instance (dag/task/run_id/map_index); the cairn operator in the "
           f"pod sets {env.KEY.name} at run time",
    "container": f"the KubernetesExecutor runs the task in the container named "
                 f"{BASE_CONTAINER!r}, the first one",
    "every": "the snapshot interval is the operator's (every_steps=/every_seconds= of "
             "@task.cairn, every= of CairnRunOperator)",
    "gpu_memory_bytes": "size the base container's memory for the GPU state in the template "
                        "itself (or per task with a pod_override)",
    "staging_bytes": "state mode's volume carries only the notice and status files; process "
                     f"mode stages in cairn run's work directory ({env.WORKDIR.name})",
    "replicated_jobs": "a pod template is a Pod, not a JobSet",
}
# Stand-ins the transform needs for one pod; removed again, and checked to be gone, so that no
# task can ever resume another task's key from the template.
_UNSET_STORE = "/cairn-pod-template/unset-store"
_UNSET_KEY = "cairn-pod-template/unset/key"
_PER_TASK_ENV = (env.STORE.name, env.KEY.name)


def load_base(base: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The base template as a dict: a copy of a mapping, or a YAML file read."""
    if isinstance(base, Mapping):
        return copy.deepcopy(dict(base))
    import yaml

    path = Path(base)
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the base pod template {path}: {e.strerror}; give the "
                          "path of your worker pod template (a Pod YAML with a 'base' "
                          "container)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} holds no Pod: a pod_template_file is one Pod manifest")
    return loaded


def _check_base(manifest: dict[str, Any]) -> None:
    kind, version = manifest.get("kind", "Pod"), manifest.get("apiVersion", "v1")
    if kind != "Pod" or version != "v1":
        raise ConfigError(f"the base template is a {version} {kind}: a pod_template_file is a v1 "
                          "Pod (apiVersion: v1, kind: Pod)")
    spec = manifest.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        raise ConfigError("the base template has no spec.containers: give it a first container "
                          f"named {BASE_CONTAINER!r} (Airflow's worker container)")
    first = containers[0].get("name") if isinstance(containers[0], dict) else None
    if first != BASE_CONTAINER:
        raise ConfigError(f"the base template's first container is {first!r}: the "
                          "KubernetesExecutor merges each task's command into the first "
                          f"container and names it {BASE_CONTAINER!r}; name it so and put it "
                          "first")


def pod_template(base: Mapping[str, Any] | str | Path, *, sidecar_image: str,
                 mode: PodMode | str = PodMode.STATE,
                 kubernetes_version: str = DEFAULT_KUBERNETES_VERSION,
                 **options: Any) -> dict[str, Any]:
    """The KubernetesExecutor pod template: ``base`` (a Pod manifest or a YAML file) with
    cairn's transform for its ``base`` container, without a key or a store (see the module
    docstring). ``options`` are :func:`cairn.k8s.with_snapshot_sidecar`'s
    :data:`TEMPLATE_OPTIONS`; the per-task ones (:data:`PER_TASK_OPTIONS`) are refused."""
    mode = coerce_option(PodMode, mode, "mode")
    for name in options:
        if name in PER_TASK_OPTIONS:
            raise ConfigError(f"a pod template does not take {name}=: {PER_TASK_OPTIONS[name]}")
        if name not in TEMPLATE_OPTIONS:
            raise ConfigError(f"unknown option {name}=; a pod template takes "
                              f"{', '.join(sorted(TEMPLATE_OPTIONS))}")
    if mode is PodMode.PROCESS and options.get("state_bytes") is not None:
        raise ConfigError("state_bytes= sizes the state-mode Checkpointer's staging; in process "
                          "mode size the base container's memory for cairn run's dump")
    manifest = load_base(base)
    _check_base(manifest)
    manifest.setdefault("apiVersion", "v1")
    manifest.setdefault("kind", "Pod")
    # State mode's transform gives every mode what the pod needs from cairn: the sidecar and
    # its notice and status files. Its process mode would wrap base's command in `cairn run`
    # with one key, which the executor replaces per task; CairnRunOperator starts it instead.
    out = with_snapshot_sidecar(manifest, store=_UNSET_STORE, key=_UNSET_KEY, mode=PodMode.STATE,
                                sidecar_image=sidecar_image, container=BASE_CONTAINER,
                                **options)
    base_container = out["spec"]["containers"][0]
    base_container["env"] = [e for e in base_container.get("env") or []
                             if e.get("name") not in _PER_TASK_ENV]
    text = json.dumps(out)
    if _UNSET_KEY in text or _UNSET_STORE in text:  # the transform put them somewhere else too
        raise AssertionError("the pod template still names the placeholder key or store")
    if mode is PodMode.PROCESS:
        out = grant_process_mode(out, container=BASE_CONTAINER)
    from cairn_airflow.kubernetes import validate_pod

    validate_pod(out, kubernetes_version=kubernetes_version, what="the pod template")
    return out


def render_pod_template(template: Mapping[str, Any], *, header: Sequence[str] = ()) -> str:
    """``template`` as YAML text: ``header`` lines as comments, then the manifest, in the
    transform's key order (the same text for the same input)."""
    import yaml

    lines = [f"# {h}".rstrip() for h in header]
    body = yaml.safe_dump(dict(template), sort_keys=False, default_flow_style=False, width=100)
    return "\n".join([*lines, body]) if lines else body


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cairn_airflow.kubernetes_executor",
        description="Write a KubernetesExecutor pod_template_file with cairn's sidecar: BASE "
                    "(your worker pod template, first container 'base') with cairn's transform "
                    "(docs/distributed-airflow.md, KubernetesExecutor).")
    p.add_argument("base", metavar="BASE", help="the base pod template (YAML)")
    p.add_argument("--sidecar-image", required=True, metavar="IMAGE",
                   help="the cairn sidecar image, pinned by tag or digest")
    p.add_argument("--mode", default="state", choices=[m.value for m in PodMode],
                   help="state (default: @task.cairn and every other task) or process (the "
                        "privileged template for CairnRunOperator tasks)")
    p.add_argument("--output", "-o", metavar="PATH", help="write here (default: stdout)")
    p.add_argument("--kubernetes-version", default=DEFAULT_KUBERNETES_VERSION, metavar="X.Y",
                   help="validate strict against this Kubernetes version (default %(default)s)")
    p.add_argument("--final-snapshot-s", type=float, metavar="S",
                   help="the measured final-snapshot time; the grace covers it plus a margin")
    p.add_argument("--grace-cap-s", type=float, metavar="S",
                   help="what the platform gives a preempted pod (GKE spot: 15)")
    p.add_argument("--state-bytes", metavar="SIZE",
                   help="state mode: the state's size (adds the Checkpointer's staging to "
                        "base's memory)")
    p.add_argument("--staging", choices=["memory", "disk"], help="the shared volume's medium")
    p.add_argument("--secret-name", metavar="NAME",
                   help="a Kubernetes Secret holding the encrypted store's secret file")
    p.add_argument("--avoid-maintenance", action="store_true",
                   help="keep the pods off nodes with scheduled maintenance")
    p.add_argument("--watch-node-label", action="store_true",
                   help="the sidecar watches its node's labels (needs node_reader_rbac)")
    p.add_argument("--no-gce", action="store_true",
                   help="not on GCE: the sidecar does not poll the metadata server")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from cairn.runtime.exits import ExitCode

    args = _parser().parse_args(argv)
    options: dict[str, Any] = {}
    for name in ("final_snapshot_s", "grace_cap_s", "state_bytes", "staging", "secret_name"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.avoid_maintenance:
        options["avoid_maintenance"] = True
    if args.watch_node_label:
        options["watch_node_label"] = True
    if args.no_gce:
        options["on_gce"] = False
    try:
        template = pod_template(args.base, sidecar_image=args.sidecar_image, mode=args.mode,
                                kubernetes_version=args.kubernetes_version, **options)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    command = ["python -m cairn_airflow.kubernetes_executor", args.base,
               "--sidecar-image", args.sidecar_image]
    if args.mode != "state":
        command += ["--mode", args.mode]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            command.append(flag)
        elif name == "on_gce":
            command.append("--no-gce")
        else:
            command += [flag, str(value)]
    if args.output:
        command += ["--output", args.output]
    text = render_pod_template(template, header=[
        "A KubernetesExecutor pod_template_file with cairn's sidecar; generated, do not edit:",
        " ".join(command)])
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
