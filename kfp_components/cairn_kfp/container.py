"""``run_command``: a container component that runs a command under ``cairn run`` (process mode).

Self-hosted KFP only. Process mode needs capabilities and ``seccompProfile: Unconfined``
(ADR 0008), which kfp-kubernetes cannot set: the cluster-side policy
``kfp_components/deploy/cairn-process-mode-policy.yaml`` adds them to pods that carry the
label :data:`cairn_kfp.kubernetes.PROCESS_MODE_LABEL` (set it with
:func:`cairn_kfp.kubernetes.add_process_mode_label`). Vertex AI Pipelines gets state mode only.

``cairn run`` takes the key as one ``--key`` value, while KFP substitutes its placeholders
reliably only as whole arguments; so the container's command is a short Python launcher
(:data:`LAUNCHER`) that receives each part as its own argument, checks that none is still a
placeholder, builds the key (percent-encoding each component), plans the try with the resume
policy (:class:`cairn.Try`: a crash loop past ``max_error_retries`` exits before the command
starts; excluded snapshots become ``--exclude-seqs``) and ``exec``s
``cairn run --store S --key K --every E --grace G -- CMD...``, whose exit code the container
ends with: 8 when the restore failed on this side (no snapshot skipped), as the launcher's own
:class:`~cairn.exceptions.RestoreFailed` would. With ``CAIRN_KFP_DRY_RUN=1`` it
prints that command line as JSON instead.
"""

# No `from __future__ import annotations`: kfp reads the container component's annotations
# as objects.

from collections.abc import Sequence
from typing import Any

from kfp import dsl

from cairn.exceptions import ConfigError
from cairn_kfp import _runtime
from cairn_kfp.component import _enclosing_loops, _loop_type, embedded_source
from cairn_kfp.images import DEFAULT_IMAGE


def _launch(argv: list[str]) -> None:
    """The launcher's main: ``argv`` = store, run id, task name, loop item, key, prefix,
    every, grace, [resume policy as JSON,] ``--``, command... (see the module docstring)."""
    import json
    import os
    import sys

    from cairn.runtime import env as contract

    policy_json = "{}"
    if len(argv) >= 11 and argv[8] != "--" and argv[9] == "--":
        policy_json, argv = argv[8], argv[:8] + argv[9:]
    if len(argv) < 10 or argv[8] != "--":
        raise SystemExit("cairn_kfp launcher: expected STORE RUN_ID TASK_NAME LOOP_ITEM KEY "
                         "PREFIX EVERY GRACE [POLICY] -- COMMAND...; got " + json.dumps(argv))
    store, run_id, task_name, loop_item, key, prefix, every, grace = argv[:8]
    command = argv[9:]
    store = store or contract.STORE.get() or ""
    try:
        if not store or "{" + "{$." in store:
            raise ValueError(f"cairn_store is {store!r}: pass a store URL as the whole value "
                             f"(or set {contract.STORE}, e.g. with "
                             "cairn_kfp.kubernetes.use_gcs_store)")
        key_text = _cairn_key(run_id=run_id, task_name=task_name,  # noqa: F821 - embedded
                              loop_item=loop_item, key=key, checkpoint_prefix=prefix)
    except ValueError as e:
        raise SystemExit(f"cairn_kfp launcher: {e}") from None
    from cairn import CairnError, ResumePolicy, Try
    from cairn.exceptions import RestoreFailed
    from cairn.runtime.exits import ExitCode
    from cairn.runtime.rollback import unkept_note
    from cairn.tries import run_argv

    try:
        this_try = Try.begin(store=store, key=key_text,
                             policy=ResumePolicy(**json.loads(policy_json)))
        this_try.check()
    except RestoreFailed as e:  # exit 8, as cairn run (which execs next) exits for it
        print(f"cairn_kfp launcher: {e}", file=sys.stderr, flush=True)
        raise SystemExit(int(ExitCode.RESTORE_FAILED)) from None
    except (CairnError, TypeError, ValueError) as e:
        raise SystemExit(f"cairn_kfp launcher: {e}") from None
    if this_try.unnumbered_note() is not None:
        print(this_try.unnumbered_note(), file=sys.stderr, flush=True)
    print(unkept_note(orchestrator="Kubeflow Pipelines"), file=sys.stderr, flush=True)
    print("cairn: resume plan: " + this_try.reason, file=sys.stderr, flush=True)
    full = run_argv(["cairn"], command, store=store, key=key_text, every=every, grace=grace,
                    exclude=this_try.exclude)
    if contract.KFP_DRY_RUN.get() == "1":
        print(json.dumps(full))
        return
    sys.stdout.flush()
    os.execvp(full[0], full)


def launcher_source() -> str:
    """The Python program the container runs with ``python3 -c``."""
    parts = [embedded_source(_runtime._cairn_key), embedded_source(_launch),
             "import sys\n_launch(sys.argv[1:])\n"]
    return "\n\n".join(parts)


LAUNCHER = launcher_source()


def run_command(command: Sequence[str], *, name: str = "run-command",
                image: str = DEFAULT_IMAGE, store: str = "", every: str = "10m",
                grace: str = "30s", resume_on: str = "any_failure",
                max_error_retries: int | None = None, loop_guard: bool = True) -> Any:
    """A container component (for one fixed ``command``) that runs it under ``cairn run``.

    ``resume_on``, ``max_error_retries`` and ``loop_guard`` are the resume policy
    (:mod:`cairn.policy.resume`), applied by the launcher before each try. Its inputs are ``cairn_store`` (default ``store``), ``cairn_run_id``, ``cairn_task_name``,
    ``cairn_loop_item``, ``cairn_key`` and ``cairn_checkpoint_prefix``, with the meanings of
    :mod:`cairn_kfp.component`; call it through :func:`call` (or pass the two placeholders
    yourself), which fills the job-id and task-name placeholders as whole values.
    """
    command = list(command)
    if not command or not all(isinstance(part, str) for part in command):
        raise ConfigError("run_command needs a command: a non-empty list of strings, such as "
                          "['python', 'train.py', '--epochs', '3']")
    if "{{$." in store:
        raise ConfigError("store= holds a KFP placeholder; pass it at call time as cairn_store=")
    import json

    from cairn import ResumePolicy

    policy = ResumePolicy(resume_on=resume_on, max_error_retries=max_error_retries,
                          loop_guard=loop_guard)  # checked now: a ConfigError names the fix
    default = policy == ResumePolicy()
    policy_args = [] if default else [json.dumps(
        {"resume_on": policy.resume_on.value, "max_error_retries": max_error_retries,
         "loop_guard": loop_guard}, sort_keys=True)]

    def spec(cairn_store: str = store, cairn_run_id: str = "", cairn_task_name: str = "",
             cairn_loop_item: str = "", cairn_key: str = "",
             cairn_checkpoint_prefix: str = "") -> dsl.ContainerSpec:
        return dsl.ContainerSpec(
            image=image,
            command=["python3", "-c", LAUNCHER],
            args=[cairn_store, cairn_run_id, cairn_task_name, cairn_loop_item, cairn_key,
                  cairn_checkpoint_prefix, every, grace, *policy_args, "--", *command],
        )

    spec.__name__ = name.replace("-", "_")
    spec.__doc__ = f"Runs {command!r} under `cairn run` (process mode; self-hosted KFP only)."
    return dsl.container_component(spec)


def call(component: Any, **kwargs: Any) -> Any:
    """Call a cairn component that has no call wrapper — a :func:`run_command` component, or
    one loaded from ``specs/*.yaml`` — filling ``cairn_run_id`` and ``cairn_task_name`` with
    the job-id and task-name placeholders (whole values), and ``cairn_loop_item`` with the
    item of the enclosing ``dsl.ParallelFor`` (such a component takes a string item; pass
    ``cairn_loop_item=`` or ``cairn_key=`` yourself for other items or nested loops)."""
    kwargs.setdefault("cairn_run_id", dsl.PIPELINE_JOB_ID_PLACEHOLDER)
    kwargs.setdefault("cairn_task_name", dsl.PIPELINE_TASK_NAME_PLACEHOLDER)
    loops = _enclosing_loops()
    if loops and "cairn_loop_item" not in kwargs and not kwargs.get("cairn_key"):
        argument = loops[-1].loop_argument
        if len(loops) > 1 or _loop_type(argument) != "str":
            raise ConfigError("this component takes a string cairn_loop_item and cannot tell "
                              "the iterations of this loop apart by itself: pass "
                              "cairn_loop_item= (a string naming the iteration) or cairn_key=")
        kwargs["cairn_loop_item"] = argument
    return component(**kwargs)
