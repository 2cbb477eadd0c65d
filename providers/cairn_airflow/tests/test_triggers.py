"""``CairnResumeTrigger`` against a real local store: what it waits for and what it yields."""

from __future__ import annotations

import asyncio
import importlib
import time
from pathlib import Path
from typing import Any

import pytest

from cairn.exceptions import ConfigError
from cairn.store import Key, SnapshotMode
from cairn import open_store
from cairn_airflow.triggers import CairnResumeTrigger, look

KEY = Key(("dag", "train", "manual__1", "-1"))


def suspended_try(url: str, *, secret: object = None) -> int:
    """One try of KEY with a snapshot, suspended on request; returns its epoch."""
    with open_store(url, secret=secret) as store:
        attempt = store.open_attempt(KEY, note={"mode": "state"})
        with attempt.snapshot(mode=SnapshotMode.STATE) as snap:
            snap.add_bytes("state.bin", b"x")
            snap.commit(step=0)
        store.records.request_suspend(KEY, by="tester", reason="the GPUs are needed")
        return attempt.epoch


async def first_event(trigger: CairnResumeTrigger) -> Any:
    async for event in trigger.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def test_it_serializes_to_its_classpath_and_kwargs(tmp_path: Path) -> None:
    trigger = CairnResumeTrigger(store_url=str(tmp_path), key=str(KEY), epoch=3,
                                 resume_after=1.5e9, poll_seconds=0.5, not_before=1.4e9)
    classpath, kwargs = trigger.serialize()
    module, name = classpath.rsplit(".", 1)
    again = getattr(importlib.import_module(module), name)(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert kwargs == {"store_url": str(tmp_path), "key": str(KEY), "epoch": 3,
                      "resume_after": 1.5e9, "poll_seconds": 0.5, "not_before": 1.4e9,
                      "secret_file": None}


@pytest.mark.parametrize("bad", [{"epoch": 0}, {"epoch": True}, {"poll_seconds": 0}])
def test_bad_arguments_are_refused(tmp_path: Path, bad: dict[str, Any]) -> None:
    args = {"store_url": str(tmp_path), "key": str(KEY), "epoch": 1, **bad}
    with pytest.raises(ConfigError):
        CairnResumeTrigger(**args)


def test_it_waits_while_held_and_fires_on_the_resume(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    epoch = suspended_try(url)
    assert look(url, str(KEY), epoch) is None

    async def scenario() -> tuple[Any, int]:
        trigger = CairnResumeTrigger(store_url=url, key=str(KEY), epoch=epoch,
                                     poll_seconds=0.05)
        waiting = asyncio.ensure_future(first_event(trigger))
        # The loop keeps running while the trigger polls: these ticks interleave with it.
        ticks = 0
        for _ in range(10):
            await asyncio.sleep(0.02)
            ticks += 1
        assert not waiting.done(), "fired while the key was still held"
        await asyncio.to_thread(_resume, url)
        return await asyncio.wait_for(waiting, timeout=30), ticks

    payload, ticks = asyncio.run(scenario())
    assert ticks == 10
    assert payload["status"] == "resumed" and payload["epoch"] == epoch
    assert payload["by"] == "operator" and payload["reason"] == "the urgent job is done"


def _resume(url: str) -> None:
    with open_store(url) as store:
        store.records.request_resume(KEY, by="operator", reason="the urgent job is done")


def test_resume_after_fires_without_a_request(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    epoch = suspended_try(url)
    trigger = CairnResumeTrigger(store_url=url, key=str(KEY), epoch=epoch,
                                 resume_after=time.time() + 0.2, poll_seconds=0.05)
    payload = asyncio.run(asyncio.wait_for(first_event(trigger), timeout=30))
    assert payload["status"] == "resume_after" and payload["epoch"] == epoch
    with open_store(url) as store:  # the trigger wrote nothing: the continuation asks
        assert store.records.suspension(KEY).held


def test_it_does_not_fire_before_not_before(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    epoch = suspended_try(url)
    _resume(url)  # resumed already: only not_before holds the event back
    not_before = time.time() + 0.5
    trigger = CairnResumeTrigger(store_url=url, key=str(KEY), epoch=epoch, poll_seconds=0.05,
                                 not_before=not_before)
    payload = asyncio.run(asyncio.wait_for(first_event(trigger), timeout=30))
    assert time.time() >= not_before and payload["status"] == "resumed"


def test_an_encrypted_store_is_read_with_the_secret_file_it_is_given(tmp_path: Path) -> None:
    from cairn.store import SecretError, load_secret_file, write_secret_file

    path = str(tmp_path / "store.secret")
    write_secret_file(path)
    url = str(tmp_path / "store")
    epoch = suspended_try(url, secret=load_secret_file(path))
    with pytest.raises(SecretError):
        look(url, str(KEY), epoch)
    assert look(url, str(KEY), epoch, secret_file=path) is None  # read, and still held
    with open_store(url, secret=load_secret_file(path)) as store:
        store.records.request_resume(KEY, by="operator")
    assert look(url, str(KEY), epoch, secret_file=path)["status"] == "resumed"


def test_a_discarded_key_releases_the_wait(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    epoch = suspended_try(url)
    with open_store(url) as store:
        store.remove(KEY)
    payload = look(url, str(KEY), epoch)
    assert payload is not None and payload["status"] == "released"
    assert "no longer suspended" in payload["reason"]


def test_an_unreadable_store_does_not_fire(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-store-here")
    trigger = CairnResumeTrigger(store_url=missing, key=str(KEY), epoch=1, poll_seconds=0.02)

    async def briefly() -> bool:
        waiting = asyncio.ensure_future(first_event(trigger))
        await asyncio.sleep(0.3)
        fired = waiting.done()
        waiting.cancel()
        return fired

    assert asyncio.run(briefly()) is False
