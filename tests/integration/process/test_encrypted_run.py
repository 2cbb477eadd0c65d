"""``cairn run`` on an encrypted store in a bucket (the real GCS server process), with real
CRIU: the process image is sealed (no byte of the workload's memory or file names in any
object), a second node resumes from it with the secret, and root refuses to restore from an
unencrypted bucket without the documented opt-out (ADR 0025)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from cairn.store import Key, write_secret_file
from cairn import open_store
from cairn.store.keyring import load_secret_file
from cairn.process.criu import has_feature
from tests.support.cairn_run import CRIU, CairnRun, can_run_criu, gone, metric_steps, wait_for

pytestmark = [pytest.mark.isolated, 
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]

WORKLOAD = Path(__file__).parents[2] / "support" / "marker_counter.py"
MARKER = b"cairn-process-marker-0d1e5b"
KEY = "dag/encrypted/1"


def _run(tmp_path: Path, url: str, env: dict[str, str], restore: str = "eager") -> CairnRun:
    work = tmp_path / "workspace"
    work.mkdir(exist_ok=True)
    return CairnRun(store=url, key=KEY, workdir=work / "cairn", logs=tmp_path / "logs", env=env,
                    extra=["--restore", restore],
                    command=[sys.executable, str(WORKLOAD), str(work / "metrics.txt"), "200",
                             "0.05"], cwd=tmp_path)


@pytest.mark.parametrize("restore", ["eager", "lazy"])
def test_a_process_snapshot_in_a_bucket_is_sealed_and_resumes_on_another_node(
        tmp_path: Path, gcs_bucket: str, restore: str) -> None:
    if restore == "lazy" and not has_feature(CRIU, "uffd-noncoop"):
        pytest.skip("this kernel has no userfaultfd for CRIU (criu check --feature uffd-noncoop)")
    url = f"gs://{gcs_bucket}/cairn"
    secret_file = tmp_path / "cairn.secret"
    write_secret_file(str(secret_file))
    env = {"CAIRN_SECRET_FILE": str(secret_file)}  # no opt-out: the store is encrypted
    metrics = tmp_path / "workspace" / "metrics.txt"
    first = _run(tmp_path, url, env)
    try:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 20, 120,
                 "20 steps")
        wait_for(lambda: first.committed() or first.proc.poll() is not None, 120, "a snapshot")
        assert first.proc.poll() is None, first.stderr
    finally:
        first.kill()
    wait_for(lambda: gone(first.child_pid()), 10, "the workload to die")
    secret = load_secret_file(str(secret_file))
    with open_store(url, create=False, secret=secret) as store:
        kept = store.snapshots(Key.parse(KEY))[0].seq
        names = [info.name for info in store.raw_backend.list("")]
        assert any(n.startswith("packs/") for n in names)
        for name in names:
            content = store.raw_backend.read(name)
            assert MARKER not in content, f"{name} holds the workload's memory in plaintext"
            assert b"metrics.txt" not in content and b"pages-" not in content, name
    shutil.rmtree(tmp_path / "workspace")  # a fresh node: only the store and the secret

    second = _run(tmp_path, url, env, restore)  # lazy: pages served from sealed chunks
    assert second.wait() == 0, second.stderr
    assert f"restored snapshot seq {kept}" in second.stderr
    assert ("lazy restore complete: every page in" in second.stderr) == (restore == "lazy")
    assert metric_steps(metrics) == list(range(200)), "every step once, resumed mid-way"

    without = _run(tmp_path, url, {})
    assert without.wait() == 2
    assert "CAIRN_SECRET_FILE" in without.stderr and "no secret is configured" in without.stderr


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_root_refuses_an_unencrypted_bucket_without_the_opt_out(
        tmp_path: Path, scheme: str, request: pytest.FixtureRequest) -> None:
    bucket = request.getfixturevalue("gcs_bucket" if scheme == "gs" else "s3_bucket")
    run = _run(tmp_path, f"{scheme}://{bucket}/plain", {})
    assert run.wait() == 2
    assert "refusing to run as root on the unencrypted store" in run.stderr
    assert "CAIRN_ALLOW_UNAUTHENTICATED_RESTORE=1" in run.stderr
    assert not (tmp_path / "workspace" / "metrics.txt").exists(), "nothing was started"
