"""Encrypted stores (ADR 0025), on the local backend and the real GCS server process: what a
bucket reader sees, and every tampering a bucket writer can do, each detected, the snapshot
skipped and the reason logged.

The rest of the store's contracts run on an encrypted store too: the ``store`` fixture of
``tests/conftest.py`` gives every store test a plain and an encrypted variant.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot, NoSnapshot
from cairn.runtime.stores import open_store as open_configured
from cairn.store import Key, SecretError, Store, StoreSettings
from cairn.store.keyring import new_secret, record_name as keyring_record, write_secret_file
from cairn.store.outcomes import Outcome, OutcomeKind, outcome_name
from cairn.store.sealing import TAG_BYTES, pack_key_id
from cairn.store.slotlog import record_name
from cairn.store.settings import CONFIG_NAME
from tests.support import tamper

KEY = Key.parse("dag/train/run-1")
OTHER = Key.parse("dag/train/run-2")
MARKER = b"cairn-test-marker-7f3a9c"
SETTINGS = StoreSettings(max_chunk_bytes=64 << 10, pack_bytes=256 << 10)


@pytest.fixture()
def secret():  # noqa: ANN201
    return new_secret(source="the test's secret")


@pytest.fixture()
def sealed(backend_url: str, secret) -> Store:  # noqa: ANN001
    store = Store.open(backend_url, settings=SETTINGS, secret=secret)
    yield store
    store.close()


def _payload(n: int) -> bytes:
    # Distinct content per snapshot, the marker inside every chunk-sized piece.
    piece = (MARKER + n.to_bytes(4, "big")) * 2048
    return piece * 4 + os.urandom(1000)


def _commit(store: Store, attempt, n: int, path: str = "secret-model-weights.bin") -> bytes:  # noqa: ANN001
    data = _payload(n)
    with attempt.snapshot() as snap:
        snap.add_bytes(path, data)
        snap.commit(step=n)
    return data


def _raw(store: Store):  # noqa: ANN202
    return store.raw_backend


def _names(store: Store) -> list[str]:
    return [info.name for info in _raw(store).list("")]


def test_a_bucket_reader_sees_names_and_sizes_only(sealed: Store, tmp_path: Path) -> None:
    attempt = sealed.open_attempt(KEY)
    data = _commit(sealed, attempt, 1)
    sealed.records.request_suspend(KEY, reason="operator note " + MARKER.decode())
    sealed.records.record_outcome(KEY, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.SUSPENDED,
                                       started_at=1.0, ended_at=2.0,
                                       detail={"note": "done " + MARKER.decode()}))
    assert sealed.records.suspension(KEY) is not None and sealed.records.outcomes(KEY)
    for name in _names(sealed):
        content = _raw(sealed).read(name)
        assert MARKER not in content, name
        assert b"secret-model-weights" not in content, name
        assert b"dag/train" not in content or name == CONFIG_NAME, name
    packs = [n for n in _names(sealed) if n.startswith("packs/")]
    assert packs and all(pack_key_id(p) == sealed.keyring.active for p in packs)
    assert sealed.restore(KEY, tmp_path / "out").manifest.step == 1
    assert (tmp_path / "out" / "secret-model-weights.bin").read_bytes() == data


def test_chunk_names_are_keyed_so_dedup_works_for_the_key_holder_only(
        backend_url: str, secret, tmp_path: Path) -> None:  # noqa: ANN001
    from cairn.store.hashing import digest

    with Store.open(backend_url, settings=SETTINGS, secret=secret) as store:
        attempt = store.open_attempt(KEY)
        first = _commit(store, attempt, 1)
        with attempt.snapshot() as snap:  # the same bytes again: all dedup
            snap.add_bytes("again.bin", first)
            again = snap.commit(step=2)
        assert again.bytes_written == 0
        chunk = again.file("again.bin").chunks[0]
        plain = first[:chunk.size]
        assert chunk.digest == store.chunk_digest(plain) != digest(plain)


def test_a_flipped_byte_in_a_sealed_chunk_is_caught(
        sealed: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    attempt = sealed.open_attempt(KEY)
    _commit(sealed, attempt, 1)
    _commit(sealed, attempt, 2)
    newest = sealed.snapshots(KEY)[0].manifest
    chunk = newest.files[0].chunks[1]
    tamper.flip_byte(sealed.backend, chunk.pack, chunk.offset + 7)
    with caplog.at_level(logging.WARNING):
        result = sealed.restore(KEY, tmp_path / "out")
    assert result.manifest.seq == newest.seq - 1
    assert "failed authentication" in caplog.text
    assert not sealed.verify(KEY).ok


def test_two_swapped_chunks_are_caught(sealed: Store, tmp_path: Path) -> None:
    attempt = sealed.open_attempt(KEY)
    _commit(sealed, attempt, 1)
    manifest = sealed.snapshots(KEY)[0].manifest
    a, b = manifest.files[0].chunks[0], manifest.files[0].chunks[1]
    assert a.pack == b.pack and a.size == b.size
    pack = bytearray(_raw(sealed).read(a.pack))
    span = a.size + TAG_BYTES
    first, second = bytes(pack[a.offset:a.offset + span]), bytes(pack[b.offset:b.offset + span])
    assert first != second
    pack[a.offset:a.offset + span], pack[b.offset:b.offset + span] = second, first
    tamper.overwrite(sealed.backend, a.pack, bytes(pack))
    with pytest.raises(NoSnapshot, match="failed authentication"):
        sealed.restore(KEY, tmp_path / "out")


def test_a_truncated_pack_is_caught(sealed: Store, tmp_path: Path) -> None:
    attempt = sealed.open_attempt(KEY)
    _commit(sealed, attempt, 1)
    _commit(sealed, attempt, 2)
    newest = sealed.snapshots(KEY)[0].manifest
    pack = newest.files[0].chunks[-1].pack
    tamper.truncate(sealed.backend, pack, _raw(sealed).stat(pack).size - 5)
    assert sealed.latest_good(KEY).seq == newest.seq - 1  # the cheap check sees it too
    assert sealed.restore(KEY, tmp_path / "out").manifest.seq == newest.seq - 1


def test_a_manifest_from_another_key_is_rejected(
        sealed: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mine = sealed.open_attempt(KEY)
    _commit(sealed, mine, 1)
    theirs = sealed.open_attempt(OTHER)
    _commit(sealed, theirs, 9)
    stolen = _raw(sealed).read(record_name(OTHER.path, sealed.snapshots(OTHER)[0].seq))
    seq = mine.log.next_seq
    _raw(sealed).create(record_name(KEY.path, seq), stolen)
    with caplog.at_level(logging.WARNING):
        snaps = sealed.snapshots(KEY)
    assert [s.manifest.step for s in snaps] == [1]
    assert "failed authentication" in caplog.text
    assert sealed.restore(KEY, tmp_path / "out").manifest.step == 1


def test_an_old_manifest_replayed_at_a_newer_seq_is_rejected(
        sealed: Store, caplog: pytest.LogCaptureFixture) -> None:
    attempt = sealed.open_attempt(KEY)
    _commit(sealed, attempt, 1)
    _commit(sealed, attempt, 2)
    old_seq = sealed.snapshots(KEY)[1].seq
    replay = _raw(sealed).read(record_name(KEY.path, old_seq))
    _raw(sealed).create(record_name(KEY.path, attempt.log.next_seq), replay)
    with caplog.at_level(logging.WARNING):
        assert sealed.snapshots(KEY)[0].manifest.step == 2
    assert "failed authentication" in caplog.text


def test_a_record_from_another_store_with_the_same_secret_is_rejected(
        backend_url: str, secret, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    with Store.open(backend_url, settings=SETTINGS, secret=secret) as here, \
            Store.open(f"{backend_url}-twin", settings=SETTINGS, secret=secret) as twin:
        _commit(here, here.open_attempt(KEY), 1)
        twin_attempt = twin.open_attempt(KEY)
        _commit(twin, twin_attempt, 5)
        _commit(twin, twin_attempt, 6)
        # The twin's newest record, at a seq the first store's key has not used yet.
        seq = twin.snapshots(KEY)[0].seq
        assert seq not in [s.seq for s in here.snapshots(KEY)]
        here.raw_backend.create(record_name(KEY.path, seq),
                                twin.raw_backend.read(record_name(KEY.path, seq)))
        with caplog.at_level(logging.WARNING):
            assert [s.manifest.step for s in here.snapshots(KEY)] == [1]
        # Each store has its own data keys (and its id in every seal's associated data).
        assert "which the store's keyring (as this secret opens it) does not hold" in caplog.text


def test_unsealed_objects_are_refused_never_a_downgrade(
        sealed: Store, backend_url: str, secret, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    attempt = sealed.open_attempt(KEY)
    _commit(sealed, attempt, 1)
    # A plaintext record and outcome, as an unencrypted store (or a bucket writer) makes them.
    with Store.open(f"{backend_url}-plain", settings=SETTINGS) as plain:
        plain_attempt = plain.open_attempt(KEY)
        for _ in range(attempt.log.next_seq - plain_attempt.epoch):
            _commit(plain, plain_attempt, 7)
        plain.records.record_outcome(KEY, Outcome(epoch=attempt.epoch, outcome=OutcomeKind.FAILED,
                                          started_at=1.0, ended_at=2.0))
        seq = attempt.log.next_seq
        sealed.raw_backend.create(record_name(KEY.path, seq),
                                  plain.raw_backend.read(record_name(KEY.path, seq)))
        name = outcome_name(KEY.path, attempt.epoch)
        sealed.raw_backend.create(name, plain.raw_backend.read(name))
    with caplog.at_level(logging.WARNING):
        assert [s.manifest.step for s in sealed.snapshots(KEY)] == [1]
        assert sealed.records.outcomes(KEY) == []
    assert "is not sealed, but this store is encrypted" in caplog.text
    # The config swapped for a plaintext store's: a process with the secret refuses it.
    tamper.overwrite(sealed.backend, CONFIG_NAME, json.dumps(
        {"format": "cairn.store/1", "gc_grace_seconds": 3600}).encode())
    with pytest.raises(SecretError, match="not encrypted, but a secret is configured"):
        Store.open(backend_url, secret=secret)


def test_a_wrong_or_missing_secret_is_a_clear_error_naming_the_setting(
        sealed: Store, backend_url: str, tmp_path: Path) -> None:
    _commit(sealed, sealed.open_attempt(KEY), 1)
    with pytest.raises(SecretError, match="no secret is configured"):
        Store.open(backend_url)
    with pytest.raises(SecretError, match="wrong secret"):
        Store.open(backend_url, secret=new_secret())
    wrong = tmp_path / "wrong.secret"
    write_secret_file(str(wrong))
    with pytest.raises(SecretError, match="CAIRN_SECRET_FILE"):
        open_configured(backend_url, environ={})
    with pytest.raises(SecretError, match=f"wrong secret.*CAIRN_SECRET_FILE={wrong}"):
        open_configured(backend_url, environ={"CAIRN_SECRET_FILE": str(wrong)})
    with pytest.raises(SecretError, match="not a cairn secret"):
        (tmp_path / "garbage").write_text("hunter2")
        open_configured(backend_url, environ={"CAIRN_SECRET_FILE": str(tmp_path / "garbage")})


def test_a_tampered_keyring_record_is_skipped_and_the_secret_still_opens_the_store(
        sealed: Store, backend_url: str, secret, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    data = _commit(sealed, sealed.open_attempt(KEY), 1)
    first_key = sealed.keyring.active
    sealed.rotate_keys()
    assert sealed.keyring.active != first_key
    tamper.flip_byte(sealed.backend, keyring_record(2), 60)
    with caplog.at_level(logging.WARNING), Store.open(backend_url, secret=secret) as again:
        assert again.keyring.active == first_key  # record 2 is skipped, record 1 opens
        assert again.reader(again.manifest(KEY)).read_file("secret-model-weights.bin") == data
    assert "skipping keyring record 2" in caplog.text


def test_rotation_keeps_old_snapshots_readable_and_seals_new_ones_with_the_new_key(
        sealed: Store, backend_url: str, secret, tmp_path: Path) -> None:  # noqa: ANN001
    attempt = sealed.open_attempt(KEY)
    old = _commit(sealed, attempt, 1)
    old_key = sealed.keyring.active
    replacement = new_secret(source="the new secret")
    sealed.rotate_keys(new_secret=replacement)
    new_key = sealed.keyring.active
    assert new_key != old_key
    new = _commit(sealed, attempt, 2, path="later.bin")
    later = sealed.manifest(KEY).file("later.bin").chunks
    assert {pack_key_id(c.pack) for c in later} == {new_key}
    with Store.open(backend_url, secret=replacement) as store:
        assert store.keyring.keys.keys() == {old_key, new_key}
        snaps = store.snapshots(KEY)
        assert store.reader(snaps[0].manifest).read_file("later.bin") == new
        assert store.reader(snaps[1].manifest).read_file("secret-model-weights.bin") == old
    with Store.open(backend_url, secret=secret) as old_view:  # the old secret: old keys only
        assert old_view.keyring.active == old_key
        with pytest.raises(CorruptSnapshot, match="does not hold"):
            old_view.reader(old_view.manifest(KEY)).read_file("later.bin")


def test_concurrent_creators_of_one_encrypted_store_agree(backend_url: str, secret) -> None:  # noqa: ANN001
    import threading

    stores: list[Store] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            stores.append(Store.open(backend_url, secret=secret))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len({s.store_id for s in stores}) == 1
    assert len({s.keyring.active for s in stores}) == 1
    for s in stores:
        s.close()


def test_an_unique_store_id_binds_each_store(backend_url: str, secret) -> None:  # noqa: ANN001
    with Store.open(backend_url, secret=secret) as a, \
            Store.open(f"{backend_url}-{uuid.uuid4().hex[:4]}", secret=secret) as b:
        assert a.store_id != b.store_id


def test_a_streamed_file_is_sealed_from_the_bytes_read_even_past_deduplicated_chunks(
        backend_url: str, secret, tmp_path: Path) -> None:  # noqa: ANN001
    """An encrypted store seals each large chunk on the pool while the next is read and hashed;
    a chunk that dedups in between must not free the buffer still being sealed."""
    from cairn.store.packs import SEAL_ON_POOL_MIN

    piece = 1 << 20
    assert piece >= SEAL_ON_POOL_MIN  # the chunks take the pool's path
    settings = StoreSettings(max_chunk_bytes=piece, pack_bytes=8 << 20)
    with Store.open(backend_url, settings=settings, secret=secret) as store:
        known = os.urandom(piece)
        attempt = store.open_attempt(KEY)
        with attempt.snapshot() as snap:
            snap.add_bytes("known.bin", known)
            snap.commit(step=1)
        fresh = [os.urandom(piece) for _ in range(12)]
        content = b"".join(part for f in fresh for part in (f, known))  # every other dedups
        (tmp_path / "big.bin").write_bytes(content)
        with attempt.snapshot() as snap:
            snap.add_file("big.bin", tmp_path / "big.bin")
            manifest = snap.commit(step=2)
        assert manifest.bytes_written == len(fresh) * piece
        assert store.reader(manifest).read_file("big.bin") == content
        assert store.verify(KEY).ok
