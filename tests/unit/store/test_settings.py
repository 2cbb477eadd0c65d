"""StoreSettings: the transfers in flight default per kind of store (ADR 0050), an explicit
value always wins, and no combination silently caps another."""

from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.store import StoreSettings
from cairn.store.settings import (
    LOCAL_INFLIGHT_PACKS,
    LOCAL_IO_THREADS,
    LOCAL_PACK_BYTES,
    LOCAL_READ_PREFETCH,
    REMOTE_INFLIGHT,
    REMOTE_PACK_BYTES,
)


def test_a_bucket_keeps_more_transfers_in_flight_than_a_directory() -> None:
    local = StoreSettings().resolved(remote=False)
    remote = StoreSettings().resolved(remote=True)
    assert (local.max_inflight_packs, local.read_prefetch, local.io_threads, local.pack_bytes) \
        == (LOCAL_INFLIGHT_PACKS, LOCAL_READ_PREFETCH, LOCAL_IO_THREADS, LOCAL_PACK_BYTES)
    assert (remote.max_inflight_packs, remote.read_prefetch, remote.io_threads,
            remote.pack_bytes) == (REMOTE_INFLIGHT, REMOTE_INFLIGHT, REMOTE_INFLIGHT,
                                   REMOTE_PACK_BYTES)
    assert remote.max_inflight_packs > local.max_inflight_packs
    assert local.resolved(remote=True) == local, "resolved settings are final"


def test_explicit_values_win_and_the_threads_cover_every_transfer() -> None:
    s = StoreSettings(max_inflight_packs=24, pack_bytes=8 << 20, keep_last=2).resolved(remote=False)
    assert (s.max_inflight_packs, s.pack_bytes, s.keep_last) == (24, 8 << 20, 2)
    assert s.io_threads == 24, "each pack in flight needs a thread"
    assert s.read_prefetch == LOCAL_READ_PREFETCH
    big_chunks = StoreSettings(max_chunk_bytes=64 << 20).resolved(remote=True)
    assert big_chunks.pack_bytes == 64 << 20, "a pack holds at least one chunk"


@pytest.mark.parametrize("options", [dict(io_threads=8, max_inflight_packs=16),
                                     dict(io_threads=4, read_prefetch=8)])
def test_threads_fewer_than_the_transfers_are_refused(options: dict) -> None:
    with pytest.raises(ConfigError, match=r"give io_threads >= \d+, or leave it unset"):
        StoreSettings(**options)


@pytest.mark.parametrize("options", [dict(io_threads=0), dict(read_prefetch=0),
                                     dict(pack_bytes=4096)])
def test_out_of_range_values_are_refused(options: dict) -> None:
    with pytest.raises(ConfigError):
        StoreSettings(**options)


def test_the_threads_given_bound_the_defaults() -> None:
    s = StoreSettings(io_threads=4, max_inflight_packs=2).resolved(remote=True)
    assert (s.io_threads, s.max_inflight_packs, s.read_prefetch) == (4, 2, 4)
