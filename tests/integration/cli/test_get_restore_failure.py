"""``cairn get`` whose reading fails on its own side (an injected library failure in the
subprocess): exit 8 naming the cause, no snapshot skipped, nothing left at the destination,
and the same command succeeds once the injection is gone (issue 32 item 4)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.runtime.exits import ExitCode
from cairn.store import Key, load_secret_file, write_secret_file
from cairn import open_store
from tests.support.hang import HANG_S
from tests.support.read_failure import INJECTED, injecting_env

KEY = "etl/train/scheduled__2026-11-29T00:00:00+00:00/0"


def cairn(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cairn.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=HANG_S)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "sealed"])
def test_cairn_get_exits_8_and_skips_nothing(tmp_path: Path, encrypted: bool) -> None:
    store = str(tmp_path / "store")
    secret: list[str] = []
    if encrypted:
        write_secret_file(str(tmp_path / "secret"))
        secret = ["--secret-file", str(tmp_path / "secret")]
    src = tmp_path / "ckpt"
    src.mkdir()
    for step in range(2):
        (src / "model.bin").write_bytes(random.Random(step).randbytes(1_000_000))
        put = cairn(*secret, "put", store, KEY, str(src), "--step", str(step))
        assert put.returncode == 0, put.stderr
    with open_store(store, create=False, secret=load_secret_file(str(tmp_path / "secret"))
                    if encrypted else None) as opened:
        seqs = [info.seq for info in opened.snapshots(Key.parse(KEY))]

    failed = cairn(*secret, "get", store, KEY, str(tmp_path / "out"),
                   env=injecting_env(tmp_path / "inject", where="decrypt" if encrypted
                                     else "part"))
    assert failed.returncode == ExitCode.RESTORE_FAILED == 8, (failed.stdout, failed.stderr)
    assert f"ValueError: {INJECTED}" in failed.stderr and f"seq {seqs[0]}" in failed.stderr
    assert "no snapshot was skipped" in failed.stderr and "skipped seq" not in failed.stdout
    assert not (tmp_path / "out").exists()

    got = cairn(*secret, "get", store, KEY, str(tmp_path / "out"), "--json")
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["seq"] == seqs[0] and doc["skipped"] == []
    assert (tmp_path / "out" / "model.bin").read_bytes() == (src / "model.bin").read_bytes()
    assert cairn(*secret, "verify", store, KEY).returncode == 0  # every snapshot still verifies
