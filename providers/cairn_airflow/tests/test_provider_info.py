"""The provider registers with Airflow: schema-valid info, connection type, ``@task.cairn``."""

from __future__ import annotations

from importlib.metadata import distribution, entry_points

import cairn_airflow


def test_provider_info_is_valid_against_airflows_schema() -> None:
    from airflow._shared.providers_discovery import _create_provider_info_schema_validator

    info = cairn_airflow.get_provider_info()
    _create_provider_info_schema_validator().validate(info)
    assert info["package-name"] == distribution("airflow-provider-cairn").metadata["Name"]
    assert info["versions"] == [cairn_airflow.__version__]
    assert info["task-decorators"] == [
        {"name": "cairn", "class-name": "cairn_airflow.decorators.cairn_task"}]
    assert [c["connection-type"] for c in info["connection-types"]] == ["cairn"]
    assert info["hooks"][0]["python-modules"] == ["cairn_airflow.hooks"]
    assert info["operators"][0]["python-modules"] == ["cairn_airflow.operators",
                                                      "cairn_airflow.command",
                                                      "cairn_airflow.kubernetes"]


def test_entry_point_resolves_to_get_provider_info() -> None:
    (ep,) = [e for e in entry_points(group="apache_airflow_provider") if e.dist.name == "airflow-provider-cairn"]
    assert ep.load() is cairn_airflow.get_provider_info


def test_every_class_named_in_the_info_imports() -> None:
    import importlib

    info = cairn_airflow.get_provider_info()
    names = [c["hook-class-name"] for c in info["connection-types"]]
    names += [d["class-name"] for d in info["task-decorators"]]
    for name in names:
        module, _, attr = name.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr)), name
    for group in info["hooks"] + info["operators"]:
        for module in group["python-modules"]:
            importlib.import_module(module)


def test_providers_manager_sees_the_provider_hook_and_decorator() -> None:
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk import task
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime
    from cairn_airflow.decorators import cairn_task
    from cairn_airflow.hooks import CairnHook

    manager = ProvidersManager()
    assert "airflow-provider-cairn" in manager.providers
    hook = ProvidersManagerTaskRuntime().hooks["cairn"]
    assert hook is not None and hook.hook_class_name == "cairn_airflow.hooks.CairnHook"
    assert hook.connection_id_attribute_name == "cairn_conn_id"
    assert CairnHook.conn_type == "cairn"
    assert "extra__cairn__store_url" in manager.connection_form_widgets
    assert manager.field_behaviours["cairn"]["hidden_fields"] == ["schema", "login", "password", "port"]
    assert task.cairn is cairn_task
    assert cairn_airflow.cairn_task is cairn_task
