"""The ``cairn`` commands that read a store and report on it: ``ls`` (keys, snapshots, tries,
a suspension), ``inspect`` (one snapshot's manifest) and ``verify`` (every chunk's digest).
They change nothing."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from cairn.cli.output import emit, progress
from cairn.cli.progress import human_size
from cairn.exceptions import NotFound
from cairn.runtime.exits import ExitCode
from cairn.store import Key, Manifest, Store
from cairn.store.outcomes import try_summaries
from cairn.store.slotlog import RecordKind
from cairn.store.store import VerifyReport, describe_shared
from cairn.store.timestamps import parse_timestamp


# -- ls ---------------------------------------------------------------------------------------

def _key_summary(store: Store, key: Key) -> dict[str, Any]:
    records = store.history(key)
    snaps = store.snapshots(key)
    last = records[-1] if records else None
    state = "done" if last is not None and last.kind is RecordKind.DONE else "active"
    held = store.records.suspension(key)
    if held is not None:
        state = held.state.value
    newest = snaps[0].manifest if snaps else None
    return {
        "key": str(key),
        "components": list(key.components),
        "state": state,
        "suspension": held.to_json() if held is not None else None,
        "snapshots": len(snaps),
        "latest_seq": newest.seq if newest else None,
        "latest_step": newest.step if newest else None,
        "latest_created_at": newest.created_at if newest else None,
        "bytes_logical": newest.bytes_logical if newest else 0,
        "tries": _tries(store, key, records),
    }


def _tries(store: Store, key: Key, records: Sequence[Any]) -> list[dict[str, Any]]:
    """What each try of ``key`` did, oldest first, kept through retention (docs/adr/0031):
    its summary, the steps its resume did not redo and the time that saved (at the tries'
    median measured pace), and how it ended (the outcome record's kind; None without one)."""
    outcomes = {o.epoch: o for o in store.records.outcomes(key)}
    summaries = try_summaries(records, outcomes.values())
    paces = sorted(v.seconds_per_step for v in summaries.values()
                   if v.seconds_per_step is not None)
    pace = paces[len(paces) // 2] if paces else None
    notes = {r.seq: r.body.get("note") or {} for r in records if r.kind is RecordKind.OPEN}
    rows = []
    for epoch, summary in sorted(summaries.items()):
        note = notes.get(epoch) if isinstance(notes.get(epoch), dict) else {}
        resumed = note.get("resumed_step")
        saved = resumed + 1 if isinstance(resumed, int) else None
        ended = outcomes.get(epoch)
        rows.append({"epoch": epoch, **summary.to_json(),
                     "resumed_from": note.get("resumed_from"), "resumed_step": resumed,
                     "steps_saved": saved,
                     "seconds_saved": saved * pace if saved is not None and pace else None,
                     "outcome": ended.outcome.value if ended else None,
                     "option": ended.option if ended else None,
                     "reason": ended.reason if ended else None})
    return rows


def _tries_lines(tries: Sequence[dict[str, Any]]) -> list[str]:
    lines = [f"{'TRY':>5} {'OUTCOME':12} {'SNAPS':>5} {'LAST STEP':>9} {'WRITTEN':>10} "
             f"{'STALLS':>8}  OPTION"]
    for t in tries:
        written = _size_or_dash(t["bytes_written"]) + ("" if t["complete"] else "+")
        stall = "-" if t["stall_s"] is None else f"{t['stall_s']:.2f}s"
        lines.append(f"{t['epoch']:>5} {_dash(t['outcome']):12} {t['snapshots']:>5} "
                     f"{_dash(t['last_step']):>9} {written:>10} {stall:>8}  "
                     f"{_dash(t['option'])}")
    if any(not t["complete"] for t in tries):
        lines.append("  +: at least (retention pruned some snapshots before they were counted)")
    return lines


def cmd_ls(args: argparse.Namespace, store: Store) -> int:
    if args.key is None:
        rows = [_key_summary(store, key) for key in store.keys()]
        lines = [f"{'KEY':40} {'STATE':16} {'SNAPS':>5} {'SEQ':>5} {'STEP':>8} {'SIZE':>10}"]
        for r in rows:
            lines.append(f"{r['key']:40} {r['state']:16} {r['snapshots']:>5} "
                         f"{_dash(r['latest_seq']):>5} {_dash(r['latest_step']):>8} "
                         f"{human_size(r['bytes_logical']):>10}")
            lines += _suspension_lines(r["suspension"])
        emit(args, rows, "\n".join(lines))
        return ExitCode.OK
    key = Key.parse(args.key)
    records = store.history(key)
    if not records:
        raise NotFound(f"key {key} has no records in {store.url}")
    rows = []
    for rec in records:
        row: dict[str, Any] = {"seq": rec.seq, "kind": rec.kind.value, "epoch": rec.epoch,
                               "created_at": rec.created_at}
        if rec.manifest is not None:
            row.update(step=rec.manifest.step, bytes_logical=rec.manifest.bytes_logical,
                       bytes_written=rec.manifest.bytes_written, files=len(rec.manifest.files))
        rows.append(row)
    lines = [f"{'SEQ':>5} {'KIND':5} {'EPOCH':>5} {'CREATED':27} {'STEP':>8} {'SIZE':>10} {'NEW':>10}"]
    for r in rows:
        lines.append(f"{r['seq']:>5} {r['kind']:5} {r['epoch']:>5} {r['created_at']:27} "
                     f"{_dash(r.get('step')):>8} {_size_or_dash(r.get('bytes_logical')):>10} "
                     f"{_size_or_dash(r.get('bytes_written')):>10}")
    held = store.records.suspension(key)
    lines += _suspension_lines(held.to_json() if held is not None else None)
    lines += ["", *_tries_lines(_tries(store, key, records))]
    # The JSON form stays a list of records (scripts read it); the suspension and the tries
    # are in `ls --json`.
    emit(args, rows, "\n".join(lines))
    return ExitCode.OK


def _suspension_lines(held: dict[str, Any] | None) -> list[str]:
    """Who asked for a suspension, when and why (and the resume), indented under its key."""
    if held is None:
        return []
    why = f": {held['reason']}" if held["reason"] else ""
    lines = [f"  {held['state']}: try {held['epoch']} asked by {held['by']} at {held['at']}{why}"]
    if held["state"] == "suspend-requested":
        waited = max(time.time() - parse_timestamp(held["at"]), 0.0)
        lines.append(f"  not honoured yet, {waited:.0f}s after the request (a running try "
                     "honours it at its next poll; state mode only inside step())")
    if held["try_outcome"] is not None:
        lines.append(f"  try {held['epoch']} ended {held['try_outcome']}")
    if held["resumed_by"] is not None:
        where = f", on capacity option {held['placement']}" if held.get("placement") else ""
        lines.append(f"  resume asked by {held['resumed_by']} at {held['resumed_at']}{where}")
    return lines


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _size_or_dash(value: int | None) -> str:
    return "-" if value is None else human_size(value)


# -- inspect ----------------------------------------------------------------------------------

def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    return {
        "key": list(manifest.key),
        "seq": manifest.seq,
        "epoch": manifest.epoch,
        "parent": manifest.parent,
        "created_at": manifest.created_at,
        "mode": manifest.mode.value,
        "step": manifest.step,
        "bytes_logical": manifest.bytes_logical,
        "bytes_written": manifest.bytes_written,
        "files": [{"path": f.path, "size": f.size, "chunks": len(f.chunks)} for f in manifest.files],
    }


def cmd_inspect(args: argparse.Namespace, store: Store) -> int:
    key = Key.parse(args.key)
    manifest = store.manifest(key, args.seq)
    doc = manifest_summary(manifest)
    doc["metadata"] = manifest.metadata
    lines = [f"key {key} seq {manifest.seq} (epoch {manifest.epoch}, parent {_dash(manifest.parent)})",
             f"created {manifest.created_at}, mode {manifest.mode.value}, step {_dash(manifest.step)}",
             f"{human_size(manifest.bytes_logical)} in {len(manifest.files)} files, "
             f"{human_size(manifest.bytes_written)} written by this snapshot"]
    lines += [f"  {f.size:>14,d}  {f.path}" for f in manifest.files]
    emit(args, doc, "\n".join(lines))
    return ExitCode.OK


# -- verify -----------------------------------------------------------------------------------

def cmd_verify(args: argparse.Namespace, store: Store) -> int:
    if args.key is None:
        return _verify_store(args, store)
    key = Key.parse(args.key)
    snaps = store.snapshots(key)
    if not snaps:
        raise NotFound(f"key {key} has no committed snapshot in {store.url}")
    total = sum(info.manifest.bytes_logical for info in snaps)
    bar = progress(args, "verify", total)
    report = store.verify(key, progress=bar)
    bar.close()
    emit(args, _verify_doc(report), "\n".join(_verify_lines(report)))
    return ExitCode.OK if report.ok else ExitCode.CORRUPT


def _verify_store(args: argparse.Namespace, store: Store) -> int:
    """Every key's retained snapshots; a chunk shared by keys is read once."""
    keys = store.keys()
    if not keys:
        raise NotFound(f"{store.url} holds no key; nothing to verify")
    checked: dict[tuple[str, int, str], str | None] = {}
    reports = []
    for key in keys:
        snaps = store.snapshots(key)
        if not snaps:
            continue  # finished and pruned, or removed: nothing retained to check
        bar = progress(args, f"verify {key}", sum(i.manifest.bytes_logical for i in snaps))
        reports.append(store.verify(key, progress=bar, checked=checked))
        bar.close()
    ok = all(r.ok for r in reports)
    lines = []
    for report in reports:
        lines += [f"{report.key}: {line}" for line in _verify_lines(report)]
    lines.append(f"{len(reports)} key(s) with snapshots of {len(keys)}, "
                 f"{sum(len(r.results) for r in reports)} snapshot(s): "
                 f"{'all ok' if ok else 'SOME BAD'}")
    emit(args, {"ok": ok, "keys": [_verify_doc(r) for r in reports]}, "\n".join(lines))
    return ExitCode.OK if ok else ExitCode.CORRUPT


def _verify_doc(report: VerifyReport) -> dict[str, Any]:
    return {
        "key": str(report.key),
        "ok": report.ok,
        "snapshots": [{"seq": s, "ok": r is None, "reason": r} for s, r in report.results.items()],
        "bad_chunks": [{"digest": d, "reason": r, "seqs": sorted(seqs)}
                       for d, (r, seqs) in report.bad_chunks.items()],
    }


def _verify_lines(report: VerifyReport) -> list[str]:
    lines = [f"seq {s}: {'ok' if r is None else 'BAD: ' + r}" for s, r in report.results.items()]
    lines += [f"corrupt {describe_shared(d, seqs)}: {r}"
              for d, (r, seqs) in report.bad_chunks.items()]
    return lines
