"""The ``cairn`` connection: which store, which credentials, and the default without one."""

from __future__ import annotations

import json

import pytest
from airflow.sdk import Connection

from cairn.exceptions import ConfigError
from cairn_airflow.hooks import CairnHook, StoreConfig, default_store_url, store_config_from_connection


def _conn(host: str | None = None, **extra: object) -> Connection:
    return Connection(conn_id="cairn_default", conn_type="cairn", host=host,
                      extra=json.dumps(extra) if extra else None)


def test_store_url_from_host_or_extra() -> None:
    assert store_config_from_connection(_conn("gs://bucket/prefix")).url == "gs://bucket/prefix"
    assert store_config_from_connection(_conn(store_url="/data/cairn")).url == "/data/cairn"
    assert store_config_from_connection(_conn(**{"extra__cairn__store_url": "/d"})).url == "/d"
    same = store_config_from_connection(_conn("/data/cairn", store_url="/data/cairn"))
    assert same.url == "/data/cairn" and same.env == {}


def test_two_stores_or_none_are_refused() -> None:
    with pytest.raises(ConfigError, match="two stores"):
        store_config_from_connection(_conn("/a", store_url="/b"))
    with pytest.raises(ConfigError, match="names no store"):
        store_config_from_connection(_conn())


def test_gcs_keyfile_becomes_the_credentials_variable() -> None:
    config = store_config_from_connection(_conn("gs://b/p", gcs_keyfile_path="/secrets/key.json"))
    assert config.env == {"GOOGLE_APPLICATION_CREDENTIALS": "/secrets/key.json"}
    with pytest.raises(ConfigError, match="not on GCS"):
        store_config_from_connection(_conn("/local", gcs_keyfile_path="/secrets/key.json"))


def test_only_allowlisted_extras_are_read(caplog: pytest.LogCaptureFixture) -> None:
    config = store_config_from_connection(
        _conn(store_url="gs://b/p", keyfile_dict='{"private_key": "x"}', project="p"))
    assert config == StoreConfig(url="gs://b/p", env={}, source="connection 'cairn_default'")
    assert "ignoring extras ['keyfile_dict', 'project']" in caplog.text


def test_default_store_without_a_cairn_default_connection(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path) -> None:
    from airflow.sdk.exceptions import AirflowNotFoundException

    def missing(cls, conn_id):  # noqa: ANN001, ANN202
        raise AirflowNotFoundException(f"The conn_id `{conn_id}` isn't defined")

    monkeypatch.setattr(CairnHook, "get_connection", classmethod(missing))
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    config = CairnHook().store_config()
    assert config.url == str(tmp_path / "cairn-store") == default_store_url()
    assert config.source.startswith("default")
    with pytest.raises(AirflowNotFoundException):  # a connection named explicitly must exist
        CairnHook(cairn_conn_id="my_store").store_config()


def test_test_connection_opens_an_existing_store(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from cairn.store import open_store

    store = tmp_path / "store"
    monkeypatch.setattr(CairnHook, "get_connection",
                        classmethod(lambda cls, conn_id: _conn(store_url=str(store))))
    ok, message = CairnHook().test_connection()
    assert not ok and "no cairn store" in message
    open_store(str(store)).close()
    assert CairnHook().test_connection() == (True, f"cairn store {store} is reachable")
