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
    with pytest.raises(ConfigError, match="is not on Google Cloud Storage"):
        store_config_from_connection(_conn("/local", gcs_keyfile_path="/secrets/key.json"))


def test_s3_fields_set_the_aws_variables() -> None:
    config = store_config_from_connection(_conn(
        "s3://bkt/p", s3_endpoint_url="http://minio:9000", s3_region="eu-west-1",
        s3_profile="training"))
    assert config.env == {"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_REGION": "eu-west-1",
                          "AWS_PROFILE": "training"}
    with pytest.raises(ConfigError, match="s3_region is set but the store 'gs://b/p' is not on "
                                          "Amazon S3"):
        store_config_from_connection(_conn("gs://b/p", s3_region="eu-west-1"))


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
    from cairn import open_store

    store = tmp_path / "store"
    monkeypatch.setattr(CairnHook, "get_connection",
                        classmethod(lambda cls, conn_id: _conn(store_url=str(store))))
    ok, message = CairnHook().test_connection()
    assert not ok and "no cairn store" in message
    open_store(str(store)).close()
    assert CairnHook().test_connection() == (True, f"cairn store {store} is reachable")


def test_an_encrypted_stores_secret_from_the_connection(tmp_path) -> None:  # noqa: ANN001
    """The extra ``secret`` (a secret file's text) becomes a private file named by
    CAIRN_SECRET_FILE for the task and its children; ``secret_file_path`` names one on the
    worker; both, or a malformed secret, are refused naming the connection."""
    import os
    import stat

    from cairn.runtime.stores import open_store
    from cairn.store import new_secret, secret_text

    text = secret_text(new_secret())
    config = store_config_from_connection(_conn(str(tmp_path / "store"), secret=text))
    path = config.env["CAIRN_SECRET_FILE"]
    assert open(path).read() == text.strip()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    again = store_config_from_connection(_conn(str(tmp_path / "store"), secret=text))
    assert again.env == config.env  # the same secret, the same file
    with open_store(config.url, environ=config.env) as store:  # created encrypted with it
        assert store.encrypted
    on_worker = store_config_from_connection(
        _conn("gs://b/p", secret_file_path="/var/run/cairn-secret/cairn.secret"))
    assert on_worker.env == {"CAIRN_SECRET_FILE": "/var/run/cairn-secret/cairn.secret"}
    with pytest.raises(ConfigError, match="gives the secret twice"):
        store_config_from_connection(_conn("/d", secret=text, secret_file_path="/x"))
    with pytest.raises(ConfigError, match="connection 'cairn_default'.*not a cairn secret"):
        store_config_from_connection(_conn("/d", secret="hunter2"))
