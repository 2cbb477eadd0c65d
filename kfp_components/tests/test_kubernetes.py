"""kfp-kubernetes helpers, checked in the compiled pipeline spec (no cluster here)."""

# No `from __future__ import annotations`: kfp reads the pipeline's annotations as objects.
import re
from pathlib import Path

import pytest
import yaml
from kfp import compiler, dsl

from cairn.exceptions import ConfigError
from cairn_kfp.kubernetes import (
    PROCESS_MODE_LABEL,
    add_process_mode_label,
    set_deadline,
    set_retries,
    use_gcs_store,
    use_pvc_store,
    use_spot_nodes,
)

ROOT = Path(__file__).resolve().parents[2]


@dsl.component(base_image="python:3.11")
def step() -> None:
    pass


def compile_docs(pipeline, tmp_path: Path) -> tuple[dict, dict]:
    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    pipeline_spec, platform_spec = yaml.safe_load_all(path.read_text())
    return pipeline_spec, platform_spec["platforms"]["kubernetes"]["deploymentSpec"]


def test_helpers_chain_and_land_in_the_spec(tmp_path: Path) -> None:
    @dsl.pipeline
    def p() -> None:
        task = step()
        assert use_gcs_store(task, "gs://bucket/cairn") is task
        assert use_spot_nodes(task) is task
        assert set_deadline(task, hours=2) is task
        assert set_retries(task, 4, backoff="45s", factor=3.0) is task
        assert add_process_mode_label(task) is task
        use_pvc_store(step(), "cairn-disk")

    spec, k8s = compile_docs(p, tmp_path)
    first = k8s["executors"]["exec-step"]
    assert first["nodeSelector"]["labels"] == {
        "cloud.google.com/gke-spot": "true", "iam.gke.io/gke-metadata-server-enabled": "true"}
    assert first["tolerations"] == [{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                                     "value": "true", "effect": "NoSchedule"}]
    assert int(first["activeDeadlineSeconds"]) == 7200
    assert first["podMetadata"]["labels"] == {PROCESS_MODE_LABEL: "true"}
    assert "secretAsVolume" not in first and "secretAsEnv" not in first  # no key files
    second = k8s["executors"]["exec-step-2"]
    assert second["pvcMount"] == [{"constant": "cairn-disk", "mountPath": "/mnt/cairn-store",
                                   "pvcNameParameter": {"runtimeValue": {"constant":
                                                                         "cairn-disk"}}}]
    tasks = spec["root"]["dag"]["tasks"]
    assert tasks["step"]["retryPolicy"] == {"maxRetryCount": 4, "backoffDuration": "45s",
                                            "backoffFactor": 3.0,
                                            "backoffMaxDuration": "3600s"}
    envs = {name: spec["deploymentSpec"]["executors"][name]["container"]["env"]
            for name in ("exec-step", "exec-step-2")}
    assert envs["exec-step"] == [{"name": "CAIRN_STORE", "value": "gs://bucket/cairn"}]
    assert envs["exec-step-2"] == [{"name": "CAIRN_STORE", "value": "/mnt/cairn-store"}]


def test_helpers_refuse_bad_values() -> None:
    with pytest.raises(ConfigError, match="gs://"):
        use_gcs_store(None, "/data/cairn")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'30s'"):
        set_retries(None, 3, backoff="30")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least 1"):
        set_retries(None, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="above zero"):
        set_deadline(None)  # type: ignore[arg-type]


def test_the_mutation_policy_matches_the_label_and_grants_adr_0008() -> None:
    policy = yaml.safe_load((ROOT / "kfp_components/deploy/cairn-process-mode-policy.yaml")
                            .read_text())
    assert policy["kind"] == "ClusterPolicy" and policy["apiVersion"] == "kyverno.io/v1"
    [rule] = policy["spec"]["rules"]
    [match] = rule["match"]["any"]
    assert match["resources"]["selector"]["matchLabels"] == {PROCESS_MODE_LABEL: "true"}
    assert match["resources"]["kinds"] == ["Pod"]
    [container] = rule["mutate"]["patchStrategicMerge"]["spec"]["containers"]
    assert container["(name)"] == "main"  # Argo's step container, not its wait sidecar
    context = container["securityContext"]
    assert context["seccompProfile"] == {"type": "Unconfined"}
    # The same capability list as the securityContext ADR 0008 recommends.
    adr = (ROOT / "docs/adr/0008-process-mode-privileges.md").read_text()
    recommended = re.search(r'add: \[([^\]]*)\]', adr).group(1)
    assert context["capabilities"]["add"] == [c.strip().strip('"') for c in
                                              recommended.split(",")]
    assert context["runAsUser"] == 0 and context["privileged"] is False
