"""The encryption commands as a user runs them (ADR 0025): ``cairn secret new``, ``--secret-file``
and ``CAIRN_SECRET_FILE`` on every command, ``cairn keys`` (ids, never key bytes; rotation),
and ``cairn doctor --store`` on encrypted and unencrypted stores."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hang import HANG_S

KEY = "etl/train/run-1"


def cairn(*args: str, check: int | None = 0, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "cairn.cli.main", *args], capture_output=True,
                          text=True, timeout=HANG_S, env={**os.environ, **(env or {})})
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


@pytest.fixture()
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "cairn.secret"
    out = cairn("secret", "new", str(path)).stdout
    assert "wrote secret s" in out and str(path) in out
    assert (path.stat().st_mode & 0o777) == 0o600
    return path


def test_a_secret_file_is_never_overwritten(secret: Path) -> None:
    before = secret.read_bytes()
    proc = cairn("secret", "new", str(secret), check=2)
    assert "never overwritten" in proc.stderr and secret.read_bytes() == before


def test_put_get_ls_verify_on_an_encrypted_store(tmp_path: Path, secret: Path,
                                                 backend_url: str) -> None:
    data = tmp_path / "model.bin"
    data.write_bytes(os.urandom(300_000) + b"plaintext-marker-91c2")
    cairn("--secret-file", str(secret), "put", backend_url, KEY, str(data), "--step", "3")
    by_env = {"CAIRN_SECRET_FILE": str(secret)}
    listed = json.loads(cairn("ls", backend_url, "--json", env=by_env).stdout)
    assert [k["key"] for k in listed] == [KEY]
    cairn("verify", backend_url, KEY, "--secret-file", str(secret))
    cairn("get", backend_url, KEY, str(tmp_path / "out"), env=by_env)
    assert (tmp_path / "out" / "model.bin").read_bytes() == data.read_bytes()
    for args in (("ls", backend_url), ("get", backend_url, KEY, str(tmp_path / "again"))):
        missing = cairn(*args, check=2)
        assert "is encrypted and no secret is configured" in missing.stderr
        assert "CAIRN_SECRET_FILE" in missing.stderr
    other = tmp_path / "other.secret"
    cairn("secret", "new", str(other))
    wrong = cairn("ls", backend_url, check=2, env={"CAIRN_SECRET_FILE": str(other)})
    assert "wrong secret" in wrong.stderr and "CAIRN_SECRET_FILE" in wrong.stderr


def test_keys_shows_ids_never_bytes_and_rotates(tmp_path: Path, secret: Path) -> None:
    store = str(tmp_path / "store")
    data = tmp_path / "f.txt"
    data.write_text("first")
    cairn("--secret-file", str(secret), "put", store, KEY, str(data))
    first = json.loads(cairn("keys", store, "--json", "--secret-file", str(secret)).stdout)
    assert len(first["keys"]) == 1 and first["active"] == first["keys"][0]["id"]
    key_bytes = json.loads(secret.read_text())["key"]
    rotated = cairn("keys", store, "--rotate", "--json", "--secret-file", str(secret)).stdout
    assert key_bytes not in rotated and base64.b64decode(key_bytes).hex() not in rotated
    doc = json.loads(rotated)
    assert len(doc["keys"]) == 2 and doc["active"] != first["active"]
    data.write_text("second")
    cairn("--secret-file", str(secret), "put", store, KEY, str(data))
    new = tmp_path / "new.secret"
    cairn("secret", "new", str(new))
    resealed = json.loads(cairn("keys", store, "--new-secret", str(new), "--json",
                                "--secret-file", str(secret)).stdout)
    assert resealed["sealed_by_secret"] == json.loads(new.read_text())["id"]
    assert resealed["active"] == doc["active"] and len(resealed["keys"]) == 2
    cairn("verify", store, KEY, "--secret-file", str(new))  # every snapshot, old key and new
    plain = str(tmp_path / "plain")
    cairn("put", plain, KEY, str(data))
    refused = cairn("keys", plain, check=2)
    assert "is not encrypted" in refused.stderr


def test_doctor_reports_encryption_and_warns_about_an_unencrypted_bucket(
        tmp_path: Path, secret: Path, gcs_bucket: str) -> None:
    data = tmp_path / "f.txt"
    data.write_text("x")
    plain_bucket = f"gs://{gcs_bucket}/plain"
    cairn("put", plain_bucket, KEY, str(data))
    report = json.loads(cairn("doctor", "--json", "--store", plain_bucket, check=None).stdout)
    check = next(c for c in report["checks"] if c["name"] == "store encryption")
    assert check["status"] == "warn" and "NOT encrypted" in check["detail"]
    assert "CAIRN_SECRET_FILE" in check["fix"]
    sealed_bucket = f"gs://{gcs_bucket}/sealed"
    cairn("--secret-file", str(secret), "put", sealed_bucket, KEY, str(data))
    report = json.loads(cairn("--secret-file", str(secret), "doctor", "--json", "--store",
                              sealed_bucket, check=None).stdout)
    check = next(c for c in report["checks"] if c["name"] == "store encryption")
    assert check["status"] == "ok" and "is encrypted" in check["detail"]
    report = json.loads(cairn("doctor", "--json", "--store", sealed_bucket, check=None).stdout)
    check = next(c for c in report["checks"] if c["name"] == "store encryption")
    assert check["status"] == "warn" and "no secret is configured" in check["detail"]
