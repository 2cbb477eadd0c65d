"""A store that cannot be reached when a try starts fails fast and names itself (ADR 0032).

Against real servers: a fake-gcs-server process that was stopped (connection refused), a
port that accepts and never answers (timed out), and a local path no directory can be made
at. Each is a :class:`StoreUnreachable` (exit 6) naming the store, what failed and the fix,
within the first contact's bound — never an empty history, which would be a fresh start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.exceptions import ConfigError, StoreUnreachable
from cairn.runtime import env
from cairn.runtime.exits import ExitCode, exit_code_for
from cairn.runtime.stores import open_store
from cairn.tries import Try
from tests.support.s3_server import FAKE_CREDENTIALS
from tests.support.stopped_gcs import EMULATOR, silent_endpoint, stopped_gcs_store

pytestmark = pytest.mark.gcs

# google-cloud-storage's DEFAULT_RETRY alone kept a refused first contact going for 85 s (its
# deadline is 120 s, and its error says "Timeout of 120.0s exceeded"); the bounded contact's
# error names the bound, which is what these tests check (no timing is asserted).


def test_a_stopped_gcs_server_is_unreachable_within_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with stopped_gcs_store() as stopped:
        monkeypatch.setenv(EMULATOR, stopped.endpoint)
        monkeypatch.setenv(env.STORE_CONNECT_TIMEOUT.name, "2s")
        with pytest.raises(StoreUnreachable) as caught:
            open_store(stopped.url, create=False)
    error = caught.value
    assert error.url == stopped.url and error.reason == "connection refused"
    text = str(error)
    assert f"cannot reach the store {stopped.url} at {stopped.endpoint}: connection refused" in text
    assert "reachable from this worker" in text
    assert f"{env.STORE_CONNECT_TIMEOUT.name}=2s bounds the wait" in text
    assert exit_code_for(error) is ExitCode.STORAGE


def test_a_server_that_never_answers_times_out_within_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with silent_endpoint() as endpoint:
        monkeypatch.setenv(EMULATOR, endpoint)
        monkeypatch.setenv(env.STORE_CONNECT_TIMEOUT.name, "1.5s")
        with pytest.raises(StoreUnreachable, match=r"gs://quiet/p at .*: timed out") as caught:
            open_store("gs://quiet/p")
    assert caught.value.reason == "timed out"
    assert f"{env.STORE_CONNECT_TIMEOUT.name}=1.5s bounds the wait" in str(caught.value)


def test_a_try_never_begins_with_an_empty_history_when_the_store_is_unreachable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store holds a snapshot of the key; the try's history read must fail, not plan a
    fresh start (``read_history`` turns only a store that does not exist into no history)."""
    with stopped_gcs_store() as stopped:
        monkeypatch.setenv(EMULATOR, stopped.endpoint)
        monkeypatch.setenv(env.STORE_CONNECT_TIMEOUT.name, "1s")
        with pytest.raises(StoreUnreachable, match="connection refused"):
            Try.begin(store=stopped.url, key=stopped.key)


def test_a_local_store_that_cannot_be_made_is_unreachable_naming_the_path(
        tmp_path: Path) -> None:
    """A path below a regular file (as a volume not mounted, or a read-only one: mkdir fails;
    this one fails for root too)."""
    blocker = tmp_path / "not-a-mount"
    blocker.write_text("")
    url = str(blocker / "store")
    with pytest.raises(StoreUnreachable) as caught:
        open_store(url)
    text = str(caught.value)
    assert f"cannot create the store directory {url} (Not a directory)" in text
    assert "writable from this worker" in text and "mounted here" in text
    assert exit_code_for(caught.value) is ExitCode.STORAGE


def test_a_bad_bound_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.STORE_CONNECT_TIMEOUT.name, "soon")
    with pytest.raises(ConfigError, match=env.STORE_CONNECT_TIMEOUT.name):
        open_store("gs://any/p")


def test_an_s3_endpoint_that_never_answers_times_out_within_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with silent_endpoint() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        for name, value in FAKE_CREDENTIALS.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv(env.STORE_CONNECT_TIMEOUT.name, "1.5s")
        with pytest.raises(StoreUnreachable, match=r"s3://quiet-bucket/p at .*: timed out") \
                as caught:
            open_store("s3://quiet-bucket/p")
    assert caught.value.reason == "timed out"
    assert f"{env.STORE_CONNECT_TIMEOUT.name}=1.5s bounds the wait" in str(caught.value)
