"""An encrypted store whose keyring Google Cloud KMS wraps (envelope encryption), through the
real google-cloud-kms client against tests/support/fake_kms.py, a FAKE Cloud KMS server (no KMS
can run here). Both backends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.kms_v1")

from cairn.runtime.stores import open_store as open_configured  # noqa: E402
from cairn.store import Key, SecretError, Store, load_secret_file  # noqa: E402
from cairn.store.keyring import KEYRING_PREFIX  # noqa: E402
from tests.support.fake_kms import FakeKms  # noqa: E402
from tests.support.hang import HANG_S

KEY = Key.parse("dag/train/run-1")
KMS_KEY = "projects/cairn-test/locations/global/keyRings/cairn/cryptoKeys/store"


@pytest.fixture()
def kms():  # noqa: ANN201
    with FakeKms() as fake:
        fake.create_key(KMS_KEY)
        fake.create_key(KMS_KEY + "-other")
        yield fake


def _secret_file(tmp_path: Path, kms: FakeKms, key: str = KMS_KEY) -> Path:
    path = tmp_path / f"kms-{key.rsplit('/', 1)[-1]}.secret"
    done = subprocess.run([sys.executable, "-m", "cairn.cli.main", "secret", "new", str(path),
                           "--kms", key, "--kms-endpoint", kms.endpoint],
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert "names the Cloud KMS key" in done.stdout
    doc = json.loads(path.read_text())
    assert doc["kms"] == key and "key" not in doc  # the file holds no key
    return path


def test_kms_wraps_the_keyring_and_the_store_works_through_it(
        kms: FakeKms, tmp_path: Path, backend_url: str) -> None:
    secret_file = _secret_file(tmp_path, kms)
    environ = {"CAIRN_SECRET_FILE": str(secret_file)}
    with open_configured(backend_url, environ=environ) as store:
        assert store.encrypted
        with store.open_attempt(KEY).snapshot() as snap:
            snap.add_bytes("model.bin", b"weights" * 10000)
            snap.commit(step=1)
        store_id = store.store_id
        records = [i.name for i in store.raw_backend.list(KEYRING_PREFIX)]
        raw = store.raw_backend.read(records[0])
    assert [c[0] for c in kms.calls] == ["encrypt"]  # the keyring, sealed once by KMS
    assert store_id.encode() in kms.calls[0][2], "the store id is KMS's authenticated data"
    assert b"naming_key" not in raw
    with open_configured(backend_url, environ=environ) as again:  # another process opens it
        reader = again.reader(again.manifest(KEY))
        assert reader.read_file("model.bin") == b"weights" * 10000
    assert [c[0] for c in kms.calls] == ["encrypt", "decrypt"]


def test_another_kms_key_or_a_denied_one_is_a_clear_error(
        kms: FakeKms, tmp_path: Path, backend_url: str) -> None:
    right = load_secret_file(str(_secret_file(tmp_path, kms)))
    with Store.open(backend_url, secret=right):
        pass
    wrong = load_secret_file(str(_secret_file(tmp_path, kms, KMS_KEY + "-other")))
    with pytest.raises(SecretError, match="wrong secret"):
        Store.open(backend_url, secret=wrong)
    kms.denied.add(KMS_KEY)
    with pytest.raises(Exception, match="cryptoKeyEncrypterDecrypter"):
        Store.open(backend_url, secret=load_secret_file(str(tmp_path / "kms-store.secret")))


def test_a_kms_keyring_record_moved_to_another_store_does_not_open(
        kms: FakeKms, tmp_path: Path, backend_url: str) -> None:
    secret = load_secret_file(str(_secret_file(tmp_path, kms)))
    with Store.open(backend_url, secret=secret) as first, \
            Store.open(backend_url + "-b", secret=secret) as second:
        name = f"{KEYRING_PREFIX}00000002"
        second.raw_backend.create(name, first.raw_backend.read(f"{KEYRING_PREFIX}00000001"))
        with Store.open(backend_url + "-b", secret=secret) as again:
            assert again.keyring.seq == 1  # the moved record fails KMS's AAD check: skipped
            assert again.keyring.active == second.keyring.active
