"""``cairn``: put, get, list, inspect, verify, remove and garbage-collect snapshots; suspend
and resume a running step.

Exit codes are stable (scripts may rely on them), defined and explained in
:mod:`cairn.runtime.exits`; ``cairn --help`` and ``cairn run --help`` print that table.

Listing commands (``ls``, ``inspect``, ``verify``, ``gc``) accept ``--json``; so do ``put``
and ``get``, which then print one JSON object describing what they did.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
from collections.abc import Iterator, Sequence

from cairn.cli.output import emit, progress
from cairn.cli.progress import human_size
from cairn.cli.report import cmd_inspect, cmd_ls, cmd_verify, manifest_summary
from cairn.version import __version__
from cairn.exceptions import CairnError, ConfigError, NotFound
from cairn.runtime import env, slurm
from cairn.runtime.durations import parse_duration
from cairn.runtime.exits import (
    OWN_CODE,
    RUN_CODES,
    RUN_ONLY,
    ExitCode,
    describe_exit_codes,
    exit_code_for,
)
from cairn.runtime.rollback import ROLLBACK_FLAG, rollback_allowed
from cairn.runtime.stores import open_store
from cairn.store import Key, Store
from cairn.store.kinds import BUILTIN as BUILTIN_KINDS



# -- put --------------------------------------------------------------------------------------

def _files_to_put(paths: Sequence[str]) -> Iterator[tuple[str, str]]:
    """``(snapshot path, source path)``: a file by its name, a directory by its contents."""
    for given in paths:
        if os.path.islink(given) and not os.path.exists(given):
            raise ConfigError(f"{given} is a dangling symlink")
        if os.path.isfile(given):
            yield os.path.basename(os.path.abspath(given)), given
        elif os.path.isdir(given):
            for dirpath, dirnames, filenames in os.walk(given):
                dirnames.sort()
                for filename in sorted(filenames):
                    source = os.path.join(dirpath, filename)
                    if os.path.islink(source) or not os.path.isfile(source):
                        raise ConfigError(f"{source} is not a regular file (symlinks and devices "
                                          "cannot be snapshotted); copy or remove it first")
                    rel = os.path.relpath(source, given).replace(os.sep, "/")
                    yield rel, source
        else:
            raise ConfigError(f"{given} does not exist or is not a file or directory")


def cmd_put(args: argparse.Namespace, store: Store) -> int:
    key = Key.parse(args.key)
    files = list(_files_to_put(args.paths))
    seen: dict[str, str] = {}
    for rel, source in files:
        if rel in seen:
            raise ConfigError(f"{source} and {seen[rel]} would both be stored as {rel!r}; "
                              "put them from different directories or rename one")
        seen[rel] = source
    total = sum(os.path.getsize(source) for _, source in files)
    attempt = store.open_attempt(key, note={"command": "cairn put"})
    bar = progress(args, "put", total)
    with attempt.snapshot(progress=bar) as snap:
        for rel, source in files:
            snap.add_file(rel, source)
        manifest = snap.commit(step=args.step)
    bar.close()
    doc = manifest_summary(manifest)
    emit(args, doc, f"committed {key} seq {manifest.seq}: {len(manifest.files)} files, "
                     f"{human_size(manifest.bytes_logical)} ({human_size(manifest.bytes_written)} new)")
    return ExitCode.OK


# -- get --------------------------------------------------------------------------------------

def cmd_get(args: argparse.Namespace, store: Store) -> int:
    key = Key.parse(args.key)
    manifest = store.manifest(key, args.seq)
    bar = progress(args, "get", manifest.bytes_logical)
    result = store.restore(key, args.dest, seq=args.seq, progress=bar)
    bar.close()
    doc = {**manifest_summary(result.manifest), "dest": os.path.abspath(args.dest),
           "skipped": [{"seq": s, "reason": r} for s, r in result.skipped]}
    lines = [f"restored {key} seq {result.manifest.seq} into {args.dest} "
             f"({human_size(result.manifest.bytes_logical)})"]
    lines += [f"  skipped seq {s}: {r}" for s, r in result.skipped]
    emit(args, doc, "\n".join(lines))
    return ExitCode.OK


# -- suspend, resume -----------------------------------------------------------------------

def cmd_request(args: argparse.Namespace, store: Store) -> int:
    """``suspend`` or ``resume``: make the request, or show the one already made."""
    key = Key.parse(args.key)
    before = store.records.suspension(key)
    if args.command == "suspend":
        request = store.records.request_suspend(key, reason=args.reason)
        made = before is None or before.suspend != request
        then = ("the running try takes a final snapshot and stops at its next poll (state "
                "mode: at the next step)")
    else:
        request = store.records.request_resume(key, reason=args.reason, placement=args.placement)
        made = before is None or before.resume != request
        then = "its next try resumes from the suspend snapshot"
        if request.placement is not None:
            then += f", on capacity option {request.placement}"
        elif args.placement is not None and not made:
            then += (f"; --placement {args.placement} changes nothing: the resume was asked "
                     "already")
    what = "asked" if made else "was already asked"
    emit(args, {"key": str(key), **request.to_json(), "new": made},
          f"{args.command} of {key} (try {request.epoch}) {what} by {request.by}; {then}")
    return ExitCode.OK


# -- rm, gc -----------------------------------------------------------------------------------

def cmd_rm(args: argparse.Namespace, store: Store) -> int:
    key = Key.parse(args.key)
    if not store.history(key):
        raise NotFound(f"key {key} has no records in {store.url}")
    removed = store.remove(key)
    emit(args, {"key": str(key), "snapshots_removed": removed},
          f"removed {key}: {removed} snapshots (run `cairn gc` to free their space)")
    return ExitCode.OK


def cmd_export(args: argparse.Namespace, store: Store) -> int:
    """A state snapshot in another tool's layout (torch.distributed.checkpoint's, --dcp)."""
    if not args.dcp:
        raise ConfigError("name the layout to export to: --dcp (torch.distributed.checkpoint's "
                          "FileSystemWriter layout, read with dcp.load(..., checkpoint_id=DIR))")
    import cairn.dcp  # torch: imported for this command only

    key = Key.parse(args.key)
    manifest = cairn.dcp.export(store, key, args.dest, seq=args.seq, rank=args.rank)
    dest = os.path.abspath(args.dest)
    doc = {**manifest_summary(manifest), "dest": dest, "layout": "dcp"}
    emit(args, doc, f"exported {key} seq {manifest.seq} into {dest} (torch.distributed."
                    f"checkpoint layout: dcp.load(state_dict, checkpoint_id={dest!r}))")
    return ExitCode.OK


def cmd_gc(args: argparse.Namespace, store: Store) -> int:
    report = store.gc(grace_seconds=args.grace, dry_run=args.dry_run)
    doc = {
        "dry_run": report.dry_run,
        "packs_total": report.packs_total,
        "packs_referenced": report.packs_referenced,
        "packs_in_grace": report.packs_in_grace,
        "packs_deleted": len(report.deleted),
        "bytes_freed": report.bytes_freed,
        "raced": report.raced,
        "unreadable_records": report.unreadable_records,
        "temporaries_removed": report.temporaries_removed,
        "packs_condemned": len(report.condemned),
        "packs_condemned_earlier": report.packs_condemned_earlier,
    }
    verb = "would free" if report.dry_run else "freed"
    text = (f"{verb} {human_size(report.bytes_freed)} in {len(report.deleted)} packs "
            f"({report.packs_referenced} in use, {report.packs_in_grace} within grace)")
    if report.condemned or report.packs_condemned_earlier:
        # A backend whose deletes a touch cannot guard (S3): ADR 0048.
        text += (f"; {'would condemn' if report.dry_run else 'condemned'} "
                 f"{len(report.condemned)} unused packs and {report.packs_condemned_earlier} "
                 "condemned earlier wait: a `cairn gc` run once they are a grace period old "
                 "deletes them")
    emit(args, doc, text)
    return ExitCode.OK


# -- parser -----------------------------------------------------------------------------------

def _duration(text: str) -> float:
    try:
        return parse_duration(text, allow_zero=True)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# -- secrets and keys (ADR 0025) ---------------------------------------------------------------

def cmd_secret_new(args: argparse.Namespace) -> int:
    from cairn.store import write_secret_file

    if args.kms_endpoint and not args.kms:
        raise ConfigError("--kms-endpoint needs --kms KEY_NAME")
    secret = write_secret_file(args.path, kms_key=args.kms, kms_endpoint=args.kms_endpoint)
    if args.kms:
        print(f"wrote secret {secret.id} to {args.path}: it names the Cloud KMS key {args.kms}, "
              "which wraps the store's keys (the file holds no key; whoever may use the key "
              f"opens the store). Use it with `cairn --secret-file {args.path} ...` or "
              f"{env.SECRET_FILE}={args.path}.")
        return ExitCode.OK
    print(f"wrote secret {secret.id} to {args.path} (mode 0600). Keep a copy: every snapshot "
          f"sealed with it is lost with it. Use it with `cairn --secret-file {args.path} ...` "
          f"or {env.SECRET_FILE}={args.path}; mount it as a Kubernetes Secret, never put it in "
          "a pod spec.")
    return ExitCode.OK


def cmd_keys(args: argparse.Namespace, store: Store) -> int:
    if not store.encrypted:
        raise ConfigError(f"the store {store.url} is not encrypted: it has no keys (create a "
                          f"new store with {env.SECRET_FILE} set to encrypt one)")
    if args.rotate or args.new_secret:
        from cairn.store import load_secret_file

        new_secret = load_secret_file(args.new_secret) if args.new_secret else None
        store.rotate_keys(new_secret=new_secret, new_data_key=args.rotate or new_secret is None)
    keyring = store.keyring
    assert keyring is not None
    doc = {"store": store.url, "store_id": store.store_id, "keyring_record": keyring.seq,
           "sealed_by_secret": keyring.secret_id, "active": keyring.active,
           "keys": [{"id": kid, "created": keyring.created.get(kid, "")} for kid in keyring.keys]}
    if args.json:
        print(json.dumps(doc, indent=2))
        return ExitCode.OK
    print(f"store {store.url} (id {store.store_id}), encrypted; keyring record {keyring.seq}, "
          f"sealed by secret {keyring.secret_id}")
    for key in doc["keys"]:
        mark = "  (active: new objects are sealed with it)" if key["id"] == keyring.active else ""
        print(f"  data key {key['id']}  created {key['created'] or '?'}{mark}")
    return ExitCode.OK


# -- doctor -----------------------------------------------------------------------------------

def cmd_doctor(args: argparse.Namespace) -> int:
    from cairn.process.doctor import run_doctor  # only doctor needs it

    report = run_doctor(preflight=args.preflight)
    store_url = args.doctor_store or env.STORE.get()
    if store_url:
        from cairn.cli.store_check import store_check
        from cairn.process.doctor import DoctorReport

        report = DoctorReport((*report.checks, store_check(store_url)), report.preflight)
    print(report.to_json() if args.json else report.format_text())
    return ExitCode.OK if report.ok else ExitCode.NOT_READY


# -- run --------------------------------------------------------------------------------------

# Built from cairn's own kinds: listing the installed distributions' would read every entry
# point on each start of every command (docs/store-backends.md).
STORE_HELP = "a directory, file:///path or a bucket (" + ", ".join(
    k.url_form for k in BUILTIN_KINDS if k.remote) + ", or an installed store backend's form)"

# Printed as written (RawDescriptionHelpFormatter), so that the table keeps its rows.
RUN_EPILOG = "\n".join([
    textwrap.fill(f"exit codes of cairn run: {OWN_CODE} when the command ends by itself; "
                  "else:", 79),
    describe_exit_codes(RUN_CODES),
    textwrap.fill("After the command exits 0 the key is marked done and its snapshots removed "
                  "(--keep to keep).", 79)])
EPILOG = ("exit codes (" + ", ".join(str(int(c)) for c in sorted(RUN_ONLY))
          + f" from cairn run only):\n{describe_exit_codes()}")


def cmd_run(args: argparse.Namespace) -> int:
    from cairn.process.restore import RestoreMode
    from cairn.process.staging import StagingMedium
    from cairn.process.supervisor import OnSuccess, RunSettings, run

    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        key = args.key or slurm.default_key()
        if not args.run_store or not key:
            raise ConfigError(f"give --store and --key (or ${env.STORE} and ${env.KEY}; in a "
                              "SLURM job the key defaults to the job's, docs/slurm.md)")
        settings = RunSettings(
            store=args.run_store, key=key, argv=tuple(command),
            workload_ignores_sigterm=slurm.job_from_env() is not None,
            every_s=None if args.every in ("0", "never") else parse_duration(args.every),
            grace_s=parse_duration(args.grace, allow_zero=True, name="--grace"),
            workdir=args.workdir, ghost_limit=args.ghost_limit_mb << 20,
            on_success=OnSuccess.KEEP if args.keep else OnSuccess.DROP,
            preflight=not args.no_preflight, echo=not args.no_echo,
            notice_file=args.notice_file or None, status_file=args.status_file or None,
            exclude_seqs=env.parse_seqs(args.exclude_seqs or "", source="--exclude-seqs"),
            allow_rollback=args.allow_rollback,
            spool_dir=None if args.no_spool else (args.spool or None),
            spool_wait_s=parse_duration(args.spool_wait, allow_zero=True, name="--spool-wait"),
            staging=StagingMedium.parse(args.staging, source=f"--staging (or ${env.STAGING})"),
            restore=RestoreMode.parse(args.restore, source=f"--restore (or ${env.RESTORE})"),
            suspend_poll_s=parse_duration(args.suspend_poll,
                                          name=f"--suspend-poll (or ${env.SUSPEND_POLL})"))
    except ConfigError as e:
        print(f"cairn run: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    return run(settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cairn", description="Verified, deduplicated snapshots for resumable pipeline steps.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cairn {__version__}")
    secret_help = (f"the secret file that opens an encrypted store (default: ${env.SECRET_FILE}); "
                   "with it a new store is created encrypted")
    parser.add_argument("--secret-file", metavar="PATH", default=None, help=secret_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, *, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("store", metavar="STORE", help=STORE_HELP)
        if json_flag:
            p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        p.add_argument("-v", "--verbose", action="store_true", help="log what is skipped and why")
        p.add_argument("--secret-file", metavar="PATH", default=argparse.SUPPRESS,
                       help=secret_help)
        return p

    p = command("put", "Snapshot files or directories under KEY (deduplicated against the last one).")
    p.add_argument("key", metavar="KEY", help="the work's key, e.g. my-dag/train/run-1 (%%2F for a '/')")
    p.add_argument("paths", metavar="PATH", nargs="+", help="files, or directories whose contents to store")
    p.add_argument("--step", type=int, default=None, help="record the training step or progress")
    p.set_defaults(func=cmd_put, create=True)

    p = command("get", "Restore the newest snapshot that verifies (or --seq N) into DEST.")
    p.add_argument("key", metavar="KEY")
    p.add_argument("dest", metavar="DEST", help="a new or empty directory")
    p.add_argument("--seq", type=int, default=None, help="restore exactly this snapshot")
    p.set_defaults(func=cmd_get, create=False)

    p = command("ls", "List keys, or one key's log.")
    p.add_argument("key", metavar="KEY", nargs="?", default=None)
    p.set_defaults(func=cmd_ls, create=False)

    p = command("inspect", "Show one snapshot's manifest (default: the newest).")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--seq", type=int, default=None)
    p.set_defaults(func=cmd_inspect, create=False)

    p = command("verify", "Read and check every retained snapshot of KEY (of every key when "
                          "KEY is left out); exit 4 if any is bad.")
    p.add_argument("key", metavar="KEY", nargs="?", default=None)
    p.set_defaults(func=cmd_verify, create=False)

    p = command("suspend", "Ask KEY's running try to take a final snapshot and stop (exit 77); "
                           "no try of KEY starts again until `cairn resume`.")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--reason", default=None, metavar="TEXT", help="why (shown by `cairn ls`)")
    p.set_defaults(func=cmd_request, create=False)

    p = command("resume", "Lift KEY's suspension: its next try resumes from the suspend snapshot.")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--reason", default=None, metavar="TEXT", help="why (shown by `cairn ls`)")
    p.add_argument("--placement", default=None, metavar="NAME",
                   help="resume on another of the step's capacity options (placement=): "
                        "pod-based steps only, once their try stopped; a step on an Airflow "
                        "worker cannot be moved")
    p.set_defaults(func=cmd_request, create=False)

    p = command("export", "Write a state snapshot of KEY (default: the newest) into DEST in "
                          "torch.distributed.checkpoint's layout (--dcp).")
    p.add_argument("key", metavar="KEY")
    p.add_argument("dest", metavar="DEST", help="a new or empty directory")
    p.add_argument("--dcp", action="store_true",
                   help="DCP's FileSystemWriter layout (the one layout so far)")
    p.add_argument("--seq", type=int, default=None, help="export exactly this snapshot")
    p.add_argument("--rank", type=int, default=0,
                   help="of a snapshot several ranks took, this rank's part (default 0)")
    p.set_defaults(func=cmd_export, create=False)

    p = command("rm", "Remove KEY's snapshots (a tombstone keeps zombie writers out).")
    p.add_argument("key", metavar="KEY")
    p.set_defaults(func=cmd_rm, create=False)

    p = command("gc", "Delete packs no snapshot references, unused for the grace period.")
    p.add_argument("--grace", type=_duration, default=None,
                   help="override the store's grace (e.g. 1h); never shorter than your longest snapshot")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted")
    p.set_defaults(func=cmd_gc, create=False)

    # doctor diagnoses the host, not a store: no STORE, so not made with command().
    help_text = "Check this host for process mode: CRIU, kernel, capabilities, seccomp, GPUs, memory."
    p = sub.add_parser("doctor", help=help_text, description=help_text)
    p.add_argument("--preflight", action="store_true",
                   help="treat what process mode cannot do without as failure (exit 7)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--store", dest="doctor_store", metavar="URL", default=None,
                   help=f"also check this store: is it encrypted (default: ${env.STORE})")
    p.set_defaults(func=cmd_doctor, store=None, verbose=False)

    help_text = ("Run a command under a supervisor that snapshots the whole process with CRIU "
                 "and, when run again with the same key, resumes it from the last snapshot.")
    p = sub.add_parser("run", help=help_text, description=help_text, epilog=RUN_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="cairn run --store URL --key KEY [options] -- CMD [ARG...]")
    p.add_argument("--store", dest="run_store", default=env.STORE.get(), metavar="URL",
                   help=f"{STORE_HELP} (default ${env.STORE})")
    p.add_argument("--key", default=None,
                   help=f"the work's key, e.g. my-dag/train/run-1 (default ${env.KEY}; in a "
                        "SLURM job slurm/CLUSTER/JOB_ID, or .../ARRAY_JOB_ID/TASK_ID)")
    p.add_argument("--every", default="10m", metavar="DURATION",
                   help="snapshot interval, like 30s, 10m or 1h; 0 for none (default 10m)")
    p.add_argument("--grace", default="30s", metavar="DURATION",
                   help="time between SIGTERM and SIGKILL (default 30s, Kubernetes' default): "
                        "a final snapshot is taken only if the last one took less")
    p.add_argument("--workdir", default=env.WORKDIR.get(),
                   help=f"logs and staging; the same path on every node (default ${env.WORKDIR} "
                        f"or {env.WORKDIR.default})")
    p.add_argument("--staging", default=env.STAGING.get(), metavar="{auto,memory,disk}",
                   help="where a dump is written before it is ingested, checked per dump: "
                        "memory (tmpfs, counted in the step's memory), disk (the work "
                        "directory), or auto: disk while its page cache takes 1.2 x the last "
                        "image before writeback throttles, else memory when the memory "
                        "cgroup's headroom covers that (default "
                        f"${env.STAGING} or {env.STAGING.default}); with --spool the spool's "
                        "volume holds the dumps")
    p.add_argument("--restore", default=env.RESTORE.get(), metavar="{eager,lazy}",
                   help="how a snapshot is restored: eager (every page in before the workload "
                        "runs) or lazy (it runs while the rest of its memory arrives, served "
                        "from verified chunks; GPU snapshots are always eager); default "
                        f"${env.RESTORE} or {env.RESTORE.default}")
    p.add_argument("--ghost-limit-mb", type=int, default=512, metavar="MB",
                   help="largest deleted-but-open file (e.g. DataLoader shared memory in "
                        "/dev/shm) saved into a snapshot (default 512)")
    p.add_argument("--keep", action="store_true",
                   help="keep the snapshots after the command succeeds")
    p.add_argument("--no-preflight", action="store_true",
                   help="skip the host checks at start (cairn doctor --preflight)")
    p.add_argument("--no-echo", action="store_true",
                   help="do not copy the command's output to this terminal")
    p.add_argument("--notice-file", default=env.NOTICE_FILE.get(), metavar="PATH",
                   help="a preemption notice file written by `cairn sidecar`, polled every "
                        f"second and treated like SIGTERM (default ${env.NOTICE_FILE})")
    p.add_argument("--status-file", default=env.STATUS_FILE.get(), metavar="PATH",
                   help="write snapshot counters here after each snapshot, for `cairn sidecar`'s "
                        f"metrics (default ${env.STATUS_FILE})")
    p.add_argument("--spool", default=env.SPOOL_DIR.get(), metavar="DIR",
                   help="hand each dump to `cairn sidecar --upload` through DIR on a shared "
                        "volume instead of writing the store: a snapshot then costs only the "
                        f"dump (default ${env.SPOOL_DIR})")
    p.add_argument("--no-spool", action="store_true",
                   help=f"write the store from this process even if ${env.SPOOL_DIR} is set")
    p.add_argument("--spool-wait", default="60s", metavar="DURATION",
                   help="at start, how long to wait for the sidecar to upload what an earlier "
                        "run spooled (default 60s; 0 not at all)")
    p.add_argument("--suspend-poll", default=env.SUSPEND_POLL.get(), metavar="DURATION",
                   help="how often to look in the store for a `cairn suspend` request "
                        f"(default ${env.SUSPEND_POLL} or {env.SUSPEND_POLL.default})")
    p.add_argument("--exclude-seqs", default=env.EXCLUDE_SEQS.get(),
                   metavar="SEQ,...",
                   help="snapshots never to restore, e.g. 12,15 (a resume policy's loop guard; "
                        f"default ${env.EXCLUDE_SEQS})")
    p.add_argument(ROLLBACK_FLAG, action="store_true", default=rollback_allowed(),
                   help="begin from the newest snapshot the store offers even when a try of "
                        "this key committed a newer one that is gone or fails its checks "
                        f"(refused otherwise; default ${env.ALLOW_ROLLBACK}=1)")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD")
    p.add_argument("--secret-file", metavar="PATH", default=argparse.SUPPRESS, help=secret_help)
    p.set_defaults(func=cmd_run, store=None)

    help_text = "make a new secret file (a key-encryption key for encrypted stores)"
    p = sub.add_parser("secret", help=help_text, description=help_text)
    secret_sub = p.add_subparsers(dest="secret_command", required=True, metavar="ACTION")
    p = secret_sub.add_parser("new", help="write a new secret to PATH (never overwrites)")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--kms", metavar="KEY_NAME", default=None,
                   help="a Cloud KMS key (projects/P/locations/L/keyRings/R/cryptoKeys/K) wraps "
                        "the store's keys instead of a key in the file")
    p.add_argument("--kms-endpoint", metavar="URL", default=None,
                   help="another Cloud KMS endpoint (regional, Private Service Connect)")
    p.set_defaults(func=cmd_secret_new, store=None, verbose=False)

    p = command("keys", "show an encrypted store's key ids (never key bytes); rotate them")
    p.add_argument("--rotate", action="store_true",
                   help="add a new data key for new snapshots (old ones stay readable)")
    p.add_argument("--new-secret", metavar="PATH", default=None,
                   help="re-seal the keyring with this secret (from now on it opens the store)")
    p.set_defaults(func=cmd_keys, create=False)

    from cairn.k8s.sidecar_cli import add_sidecar_parser  # stdlib only, like this module

    add_sidecar_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "secret_file", None):
        # Through the environment, so that what this command starts (cairn run's uploader and
        # restores, a Checkpointer's writer process) opens the store with it too.
        os.environ[env.SECRET_FILE.name] = os.path.abspath(args.secret_file)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"cairn {args.command}: %(message)s"
                        if args.command in ("run", "sidecar") else "cairn: %(message)s")
    try:
        if args.store is None:  # a host command (doctor, run)
            return args.func(args)
        with open_store(args.store, create=args.create) as store:
            return args.func(args, store)
    except KeyboardInterrupt:
        print("cairn: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`cairn ls | head`); that is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK
    except (CairnError, OSError) as e:
        code = exit_code_for(e)
        print(f"cairn: error: {e}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
