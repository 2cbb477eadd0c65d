"""Tamper tests for ``cairn get`` and ``Store.restore`` (issue 15), each on both backends (local
and the fake-gcs-server process): a setuid file comes back without its setuid bit, and a
manifest naming a path outside the destination is refused with the reason and writes nothing
outside it. Runs ``cairn get`` as the user runs it, a subprocess; as root where it matters."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store import Key, Store
from cairn.store.manifest import MANIFEST_SCHEMA
from cairn.store.slotlog import record_name
from tests.support import tamper
from tests.support.hang import HANG_S

KEY = "etl/tools/run-1/0"


def _cairn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cairn.cli.main", *args], capture_output=True,
                          text=True, timeout=HANG_S)


def test_cairn_get_of_a_setuid_file_drops_the_bit(backend_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    tool = src / "tool"
    tool.write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(tool, 0o4755)
    (src / "shared").write_bytes(b"x")
    os.chmod(src / "shared", 0o2775 | stat.S_ISVTX)
    put = _cairn("put", backend_url, KEY, str(src), "--json")
    assert put.returncode == 0, put.stderr
    got = _cairn("get", backend_url, KEY, str(tmp_path / "out"))
    assert got.returncode == 0, got.stderr
    restored = os.stat(tmp_path / "out" / "tool")
    assert stat.S_IMODE(restored.st_mode) == 0o755  # no setuid, even restored as root
    assert stat.S_IMODE(os.stat(tmp_path / "out" / "shared").st_mode) == 0o775
    assert "mode 4755 of tool masked to 0755" in got.stderr
    if os.geteuid() == 0:
        assert restored.st_uid == 0  # owned by whoever restores: no owner from the snapshot


def test_a_crafted_setuid_mode_is_masked_on_restore(store: Store, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    attempt = store.open_attempt(Key.parse(KEY))
    with attempt.snapshot() as snap:
        snap.add_bytes("bin/sh", b"\x7fELF", mode=0o6777)
        snap.commit()
    with caplog.at_level(logging.WARNING, logger="cairn.store"):
        store.restore(Key.parse(KEY), tmp_path / "out")
    assert stat.S_IMODE(os.stat(tmp_path / "out" / "bin" / "sh").st_mode) == 0o777
    assert "mode 6777 of bin/sh masked to 0777" in caplog.text


def test_a_manifest_naming_a_path_outside_is_refused(store: Store, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A bucket writer rewrites the newest ``snap`` record to name ``../outside/victim``: the
    restore refuses it, says why, and falls back to the previous snapshot."""
    key = Key.parse(KEY)
    attempt = store.open_attempt(key)
    for content in (b"good", b"newer"):
        with attempt.snapshot() as snap:
            snap.add_bytes("model.bin", content)
            snap.commit()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    newest = store.snapshots(key)[0]
    name = record_name(key.path, newest.seq)
    doc = json.loads(store.backend.read(name))
    assert doc["manifest"]["schema"] == MANIFEST_SCHEMA
    for n, path in enumerate(("../outside/victim", "/etc/cairn-tamper-victim")):
        doc["manifest"]["files"][0]["path"] = path
        tamper.overwrite_record(store, name, json.dumps(doc).encode())
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            result = store.restore(key, tmp_path / f"out-{n}")
        assert result.manifest.seq == newest.seq - 1  # the previous, untampered one
        assert f"skipping manifest of seq {newest.seq} is invalid: file path {path!r}" in \
            caplog.text
        assert (tmp_path / f"out-{n}" / "model.bin").read_bytes() == b"good"
        assert (outside / "victim").read_bytes() == b"precious"
    assert not Path("/etc/cairn-tamper-victim").exists()
    with pytest.raises(CorruptSnapshot, match="'..'|absolute"):  # asked for by its seq
        store.restore(key, tmp_path / "out-exact", seq=newest.seq)
