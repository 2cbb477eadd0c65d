"""The ``cairn`` command as a user runs it: a real subprocess, exit codes and ``--json``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from cairn.store import Key
from cairn import open_store
from tests.support import tamper
from tests.support.hang import HANG_S

KEY = "etl/train/scheduled__2026-11-29T00:00:00+00:00/0"


def cairn(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "cairn.cli.main", *args],
                          capture_output=True, text=True, timeout=HANG_S)
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


@pytest.fixture()
def workdir(tmp_path):  # noqa: ANN201
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "model.bin").write_bytes(random.Random(1).randbytes(3_000_000))
    (src / "sub" / "meta.json").write_text('{"step": 1}')
    os.chmod(src / "model.bin", 0o600)
    return tmp_path


def test_put_get_ls_inspect_round_trip(workdir, backend_url: str) -> None:
    put = json.loads(cairn("put", backend_url, KEY, str(workdir / "ckpt"), "--step", "10", "--json").stdout)
    assert put["seq"] == 2 and put["step"] == 10 and put["bytes_written"] == put["bytes_logical"]
    again = json.loads(cairn("put", backend_url, KEY, str(workdir / "ckpt"), "--json").stdout)
    assert again["bytes_written"] == 0 and again["parent"] == put["seq"]

    cairn("get", backend_url, KEY, str(workdir / "out"))
    assert (workdir / "out" / "model.bin").read_bytes() == (workdir / "ckpt" / "model.bin").read_bytes()
    assert (workdir / "out" / "sub" / "meta.json").read_text() == '{"step": 1}'
    assert (os.stat(workdir / "out" / "model.bin").st_mode & 0o777) == 0o600

    keys = json.loads(cairn("ls", backend_url, "--json").stdout)
    assert [k["key"] for k in keys] == [KEY] and keys[0]["snapshots"] == 2
    log = json.loads(cairn("ls", backend_url, KEY, "--json").stdout)
    assert [r["kind"] for r in log] == ["open", "snap", "open", "snap"]
    inspect = json.loads(cairn("inspect", backend_url, KEY, "--seq", str(put["seq"]), "--json").stdout)
    assert {"seq", "bytes_logical", "bytes_written", "files"} <= set(inspect)
    assert sorted(f["path"] for f in inspect["files"]) == ["model.bin", "sub/meta.json"]
    assert "2.9 MiB" in cairn("inspect", backend_url, KEY).stdout


def test_verify_exit_code_names_the_bad_snapshot(workdir, backend_url: str) -> None:
    cairn("put", backend_url, KEY, str(workdir / "ckpt"))
    (workdir / "ckpt" / "model.bin").write_bytes(random.Random(2).randbytes(3_000_000))
    cairn("put", backend_url, KEY, str(workdir / "ckpt"))
    assert json.loads(cairn("verify", backend_url, KEY, "--json").stdout)["ok"] is True
    store = open_store(backend_url, create=False)
    newest, older = [i.manifest for i in store.snapshots(Key.parse(KEY))]
    chunk = next(c for c in newest.chunk_refs() if c not in set(older.chunk_refs()))
    tamper.flip_byte(store.backend, chunk.pack, chunk.offset)
    proc = cairn("verify", backend_url, KEY, check=4)
    assert f"seq {newest.seq}: BAD" in proc.stdout and f"seq {older.seq}: ok" in proc.stdout
    got = json.loads(cairn("get", backend_url, KEY, str(workdir / "out"), "--json").stdout)
    assert got["seq"] == older.seq and got["skipped"][0]["seq"] == newest.seq


def test_verify_without_a_key_checks_every_key_and_names_the_bad_one(workdir, backend_url: str
                                                                      ) -> None:
    other = KEY.replace("/train/", "/eval/")
    cairn("put", backend_url, KEY, str(workdir / "ckpt"))
    (workdir / "ckpt" / "sub" / "meta.json").write_text('{"step": 2}')
    cairn("put", backend_url, other, str(workdir / "ckpt"))  # shares model.bin's chunks
    whole = json.loads(cairn("verify", backend_url, "--json", "-q").stdout)
    assert whole["ok"] is True and sorted(k["key"] for k in whole["keys"]) == sorted([KEY, other])
    store = open_store(backend_url, create=False)
    mine = store.snapshots(Key.parse(KEY))[0].manifest
    theirs = set(store.snapshots(Key.parse(other))[0].manifest.chunk_refs())
    only_mine = next(c for c in mine.chunk_refs() if c not in theirs)
    tamper.flip_byte(store.backend, only_mine.pack, only_mine.offset)
    proc = cairn("verify", backend_url, "-q", check=4)
    assert f"{KEY}: seq {mine.seq}: BAD" in proc.stdout, proc.stdout
    assert f"{other}: seq 2: ok" in proc.stdout, proc.stdout
    assert "2 key(s) with snapshots of 2, 2 snapshot(s): SOME BAD" in proc.stdout


def test_verify_without_a_key_on_an_empty_store_says_so(backend_url: str) -> None:
    open_store(backend_url, create=True).close()
    proc = cairn("verify", backend_url, check=3)
    assert "holds no key" in proc.stderr


def test_rm_then_gc_frees_space(workdir, backend_url: str) -> None:
    cairn("put", backend_url, KEY, str(workdir / "ckpt"))
    assert "removed" in cairn("rm", backend_url, KEY).stdout
    dry = json.loads(cairn("gc", backend_url, "--grace", "0s", "--dry-run", "--json").stdout)
    assert dry["dry_run"] and dry["packs_deleted"] >= 1
    gc = json.loads(cairn("gc", backend_url, "--grace", "0", "--json").stdout)
    assert gc["packs_deleted"] == dry["packs_deleted"] and gc["bytes_freed"] >= 3_000_000
    assert json.loads(cairn("ls", backend_url, "--json").stdout)[0]["state"] == "done"


def test_rm_then_gc_on_s3_condemns_then_frees(workdir, s3_bucket: str) -> None:
    """On S3 (moto's server, a fake of S3) the first pass condemns and says when space is
    freed; the pass a grace later frees it (ADR 0048)."""
    url = f"s3://{s3_bucket}/cli"
    cairn("put", url, KEY, str(workdir / "ckpt"))
    cairn("rm", url, KEY)
    time.sleep(1.2)  # S3's clock step: GC counts ages from the end of the second
    first = cairn("gc", url, "--grace", "0")
    assert "condemned" in first.stdout and "a `cairn gc` run once they are a grace period " \
        "old deletes them" in first.stdout, first.stdout
    time.sleep(1.2)
    gc = json.loads(cairn("gc", url, "--grace", "0", "--json").stdout)
    assert gc["packs_deleted"] >= 1 and gc["bytes_freed"] >= 3_000_000
    assert gc["packs_condemned"] == 0


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["get", "{store}", "no/such/key", "{tmp}/out"], 3, "no committed snapshot"),
        (["ls", "{tmp}/nostore"], 3, "no cairn store"),
        (["ls", "ftp://bucket"], 2, "unsupported store URL scheme"),
        (["put", "{store}", "a//b", "{tmp}/ckpt"], 2, "empty"),
        (["put", "{store}", "k", "{tmp}/missing"], 2, "does not exist"),
        (["get", "{store}", KEY, "{tmp}/ckpt"], 2, "not empty"),
        (["inspect", "{store}", KEY, "--seq", "99"], 3, "no record at seq 99"),
        (["gc", "{store}", "--grace", "soon"], 2, "duration"),
    ],
)
def test_bad_input_gets_exit_code_and_fix(workdir, args: list[str], code: int, message: str) -> None:
    store = str(workdir / "store")
    cairn("put", store, KEY, str(workdir / "ckpt"))
    proc = cairn(*[a.format(store=store, tmp=workdir) for a in args], check=code)
    assert message in proc.stderr


def test_symlink_inside_a_directory_is_refused(workdir) -> None:
    os.symlink(workdir / "ckpt" / "model.bin", workdir / "ckpt" / "link")
    proc = cairn("put", str(workdir / "store"), KEY, str(workdir / "ckpt"), check=2)
    assert "not a regular file" in proc.stderr


def test_suspend_and_resume_a_running_step(tmp_path) -> None:  # noqa: ANN001
    url = str(tmp_path / "store")
    key, other = Key.parse(KEY), Key.parse("etl/load/run/0")
    with open_store(url) as store:
        epoch = store.open_attempt(key).epoch
        store.open_attempt(other).finish()
    unknown = cairn("suspend", url, "no/such/key", check=3)
    assert "unknown" in unknown.stderr
    ask = json.loads(cairn("suspend", url, KEY, "--reason", "urgent job", "--json").stdout)
    assert (ask["kind"], ask["epoch"], ask["reason"], ask["new"]) == (
        "suspend", epoch, "urgent job", True)
    again = json.loads(cairn("suspend", url, KEY, "--reason", "other", "--json").stdout)
    assert (again["new"], again["reason"], again["at"]) == (False, "urgent job", ask["at"])

    (row,) = [r for r in json.loads(cairn("ls", url, "--json").stdout) if r["key"] == KEY]
    assert row["state"] == "suspend-requested"
    assert {k: row["suspension"][k] for k in ("by", "at", "reason")} == {
        "by": ask["by"], "at": ask["at"], "reason": "urgent job"}
    text = cairn("ls", url).stdout
    assert f"asked by {ask['by']} at {ask['at']}: urgent job" in text
    assert "not honoured yet" in text, "a try that has not stopped yet is shown as such"
    assert "urgent job" in cairn("ls", url, KEY).stdout

    moved = cairn("resume", url, KEY, "--placement", "a100-ondemand", check=2)
    assert "has not stopped" in moved.stderr and "nothing was changed" in moved.stderr
    resume = json.loads(cairn("resume", url, KEY, "--json").stdout)
    assert (resume["kind"], resume["epoch"], resume["new"]) == ("resume", epoch, True)
    assert json.loads(cairn("resume", url, KEY, "--json").stdout)["new"] is False

    done = cairn("suspend", url, str(other), check=2)
    assert "is done" in done.stderr
    never = cairn("resume", url, str(other), check=2)
    assert "not suspended" in never.stderr
    with open_store(url, create=False) as store:
        assert store.records.requests(other) == [], "refused asks write nothing"
