"""A snapshot writer to SIGKILL: ``python -m tests.support.crash_writer WORKDIR SEED``.

It commits snapshots of one key to the store ``WORKDIR/store`` (or the URL in
``$CAIRN_CRASH_STORE_URL``), forever, and after each commit
returns appends ``"<seq> <n>\\n"`` to ``WORKDIR/acks`` with flush and fsync. Snapshot ``n``
(counted from 0) holds exactly :func:`snapshot_files` ``(SEED, n)``, so the killing test can
regenerate every byte. It prints ``ready`` once imported, so the kill can be timed from there."""

from __future__ import annotations

import os
import random
import sys

from cairn.store.keys import Key
from cairn.store.settings import StoreSettings
from cairn import open_store

KEY = Key.parse("crash/train/run-1/0")
# Small chunks and packs: every snapshot seals several packs on background threads, so a
# kill lands in pack writes, fsyncs, publishing, record creation or retention pruning.
SETTINGS = StoreSettings(max_chunk_bytes=256 << 10, pack_bytes=1 << 20, max_inflight_packs=2,
                         io_threads=2, keep_last=3)
MAX_SNAPSHOTS = 500  # a safety stop, should the test never kill it


def snapshot_files(seed: int, n: int) -> dict[str, bytes]:
    """The files of snapshot ``n`` of a run seeded ``seed`` (1-6 MiB in all)."""
    static = random.Random(f"static:{seed}:{n // 4}")
    fresh = random.Random(f"snapshot:{seed}:{n}")
    return {
        # Changes every fourth snapshot, so most snapshots dedup it against their parent.
        "static/vocab.bin": static.randbytes(static.randrange(256 << 10, 1 << 20)),
        "model/weights.bin": fresh.randbytes(fresh.randrange(768 << 10, 4 << 20)),
        "optim/state.bin": fresh.randbytes(fresh.randrange(0, 1 << 20)),  # may be empty
    }


#: A store URL to write to instead of ``WORKDIR/store`` (the S3 kill trials).
STORE_URL_ENV = "CAIRN_CRASH_STORE_URL"


def store_dir(workdir: str) -> str:
    return os.environ.get(STORE_URL_ENV) or os.path.join(workdir, "store")


def ack_path(workdir: str) -> str:
    return os.path.join(workdir, "acks")


def main(workdir: str, seed: int) -> None:
    print("ready", flush=True)
    store = open_store(store_dir(workdir), settings=SETTINGS)
    attempt = store.open_attempt(KEY)
    with open(ack_path(workdir), "a", encoding="ascii") as acks:
        for n in range(MAX_SNAPSHOTS):
            files = snapshot_files(seed, n)
            with attempt.snapshot() as snap:
                for path, data in files.items():
                    if path.startswith("model/"):  # one file goes through add_file
                        source = os.path.join(workdir, "weights.bin")
                        with open(source, "wb") as f:
                            f.write(data)
                        snap.add_file(path, source)
                    else:
                        snap.add_bytes(path, data)
                manifest = snap.commit(step=n, user={"n": n})
            acks.write(f"{manifest.seq} {n}\n")
            acks.flush()
            os.fsync(acks.fileno())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
