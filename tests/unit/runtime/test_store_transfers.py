"""CAIRN_STORE_TRANSFERS (ADR 0050): the user's number of transfers in flight reaches every
store a process opens, where the code left the kind's default; a bad value names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.exceptions import ConfigError
from cairn.runtime.stores import open_store, with_transfers
from cairn.store import StoreSettings
from cairn.store.settings import LOCAL_INFLIGHT_PACKS, REMOTE_INFLIGHT


def test_a_store_opens_with_its_kinds_transfers(tmp_path: Path, s3_bucket: str) -> None:
    with open_store(str(tmp_path / "store"), environ={}) as local:
        assert local.settings.max_inflight_packs == LOCAL_INFLIGHT_PACKS
        assert local.pool._max_workers == local.settings.io_threads
    with open_store(f"s3://{s3_bucket}/p", environ={}) as bucket:
        assert bucket.settings.max_inflight_packs == REMOTE_INFLIGHT
        assert bucket.pool._max_workers >= REMOTE_INFLIGHT


def test_the_variable_sets_what_the_code_left_to_the_kind(tmp_path: Path) -> None:
    environ = {"CAIRN_STORE_TRANSFERS": "24"}
    with open_store(str(tmp_path / "store"), environ=environ) as store:
        assert (store.settings.max_inflight_packs, store.settings.read_prefetch,
                store.settings.io_threads) == (24, 24, 24)
    kept = with_transfers(StoreSettings(max_inflight_packs=2), environ)
    assert (kept.max_inflight_packs, kept.read_prefetch, kept.io_threads) == (2, 24, 24)
    capped = with_transfers(StoreSettings(io_threads=4), environ)
    assert (capped.max_inflight_packs, capped.read_prefetch, capped.io_threads) == (4, 4, 4)


@pytest.mark.parametrize("value", ["0", "257", "many", "-3"])
def test_a_bad_value_names_the_variable_and_the_range(value: str) -> None:
    with pytest.raises(ConfigError, match=r"CAIRN_STORE_TRANSFERS=.*from 1 to 256"):
        with_transfers(StoreSettings(), {"CAIRN_STORE_TRANSFERS": value})
