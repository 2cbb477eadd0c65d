"""``cairn run`` with real CRIU whose bucket is behind a faulty link (issue 34): 503s, resets
and stalls injected by the link harness between cairn and a real storage server process
(fake-gcs-server or moto's S3 server: fakes of GCS and S3). Snapshots commit or are reported
not committed while the workload keeps running; a fresh node restores through the same link
and every step runs exactly once; the store verifies clean through a clean link."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from cairn import open_store
from cairn.store import Key, write_secret_file
from cairn.store.keyring import load_secret_file
from tests.support.cairn_run import CRIU, CairnRun, can_run_criu, gone, metric_steps, wait_for
from tests.support.link import Faults, LinkProxy

pytestmark = [pytest.mark.isolated, pytest.mark.slow,
              pytest.mark.skipif(not can_run_criu(),
                                 reason="needs root and a criu binary (make criu)")]
del CRIU

WORKLOAD = Path(__file__).parents[2] / "support" / "marker_counter.py"
KEY = "dag/faulty-link/1"
#: Every 7th request answered 503; a reset once 2 MiB more went to the client; a 1 s stall
#: once 6 MiB more did (a process image is tens of MiB).
FAULTS = Faults(status_every=7, reset_every_bytes=2 << 20, stall_every_bytes=6 << 20,
                stall_s=1.0)


def _run(tmp_path: Path, url: str, env: dict[str, str]) -> CairnRun:
    work = tmp_path / "workspace"
    work.mkdir(exist_ok=True)
    return CairnRun(store=url, key=KEY, workdir=work / "cairn", logs=tmp_path / "logs", env=env,
                    command=[sys.executable, str(WORKLOAD), str(work / "metrics.txt"), "200",
                             "0.05"], cwd=tmp_path)


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_process_run_through_a_faulty_link_resumes_every_step_once(
        tmp_path: Path, scheme: str, request: pytest.FixtureRequest) -> None:
    if scheme == "gs":
        bucket = request.getfixturevalue("gcs_bucket")
        server = urlsplit(request.getfixturevalue("gcs_server"))
        target, variable = (server.hostname, server.port), "STORAGE_EMULATOR_HOST"
    else:
        bucket = request.getfixturevalue("s3_bucket")
        target, variable = ("127.0.0.1", request.getfixturevalue("s3_server").port), \
            "AWS_ENDPOINT_URL"
    url = f"{scheme}://{bucket}/cairn"
    secret_file = tmp_path / "cairn.secret"
    write_secret_file(str(secret_file))
    metrics = tmp_path / "workspace" / "metrics.txt"
    with LinkProxy(target, faults=FAULTS) as link:
        env = {"CAIRN_SECRET_FILE": str(secret_file), variable: f"http://{link.address}"}
        first = _run(tmp_path, url, env)
        try:
            wait_for(lambda: len(first.committed()) >= 2 or first.proc.poll() is not None, 180,
                     "two snapshots")
            assert first.proc.poll() is None, first.stderr  # the workload kept running
        finally:
            first.kill()
        wait_for(lambda: gone(first.child_pid()), 10, "the workload to die")
        with open_store(url, create=False, secret=load_secret_file(str(secret_file))) as store:
            kept = store.snapshots(Key.parse(KEY))[0].seq
        assert kept >= max(first.committed()), "a committed snapshot is missing"
        shutil.rmtree(tmp_path / "workspace")  # a fresh node: only the store and the secret

        second = _run(tmp_path, url, env)
        assert second.wait() == 0, second.stderr
        stats = link.stats.snapshot()
    assert f"restored snapshot seq {kept}" in second.stderr
    assert metric_steps(metrics) == list(range(200)), "every step once, resumed mid-way"
    print(f"\n{scheme}: faults injected {stats}")
    assert stats["statuses"] >= 3 and stats["resets"] >= 1, stats
    with open_store(url, create=False, secret=load_secret_file(str(secret_file))) as store:
        report = store.verify(Key.parse(KEY))
        assert report.ok, report.results
    assert os.path.exists(secret_file)
