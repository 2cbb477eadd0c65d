"""Rollback refused across a Job's pods (ADR 0049, ``cairn.k8s.committed``), with ``cairn
sidecar`` as a real process per pod against a FAKE Kubernetes API server (none can run here)
and real torch state under the Checkpointer: the first pod's commits reach the Job's
annotation; a bucket writer deletes the newest snapshot; the Job's next pod, a fresh shared
volume, is seeded from the annotation before it starts and refuses to roll the work back,
naming the annotation. Without that seeding the same try restores the older snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn import open_store
from cairn.exceptions import RollbackRefused
from cairn.k8s.committed import ANNOTATION, STARTED_PATH, parse_entries
from cairn.store import Key
from cairn.store.slotlog import record_name
from tests.integration.k8s.fakes import JOB, FakeKubernetesAPI
from tests.integration.k8s.test_sidecar import SidecarProcess
from tests.support.committed_tries import committed_try
from tests.support.cairn_run import wait_for

KEY = Key.parse("ml/train/0")


def _pod(tmp_path: Path, name: str, api: FakeKubernetesAPI, token: Path,
         monkeypatch: pytest.MonkeyPatch) -> SidecarProcess:
    """A new pod of the Job: its own shared volume, which this process (the main container)
    and the sidecar both keep their committed-seq files on, as the transform sets them."""
    shared = tmp_path / name
    shared.mkdir()
    monkeypatch.setenv("CAIRN_COMMITTED_DIR", str(shared / "committed"))
    sidecar = SidecarProcess(shared, tmp_path / f"{name}-logs", "--no-metadata", "--owner-job",
                             "/".join(JOB), "--kube-api", api.url, "--kube-token-file",
                             str(token))
    # The kubelet starts the main container once the sidecar's startup probe passes.
    wait_for(lambda: sidecar.get(STARTED_PATH)[0] == 200, 30, "the sidecar's startup probe")
    return sidecar



def test_the_jobs_next_pod_refuses_what_its_first_pod_committed(
        tmp_path: Path, fake_api: tuple[FakeKubernetesAPI, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    api, token = fake_api
    with open_store(str(tmp_path / "store")) as store:
        first = _pod(tmp_path, "pod-0", api, token, monkeypatch)
        try:
            ckpt, _ = committed_try(store, KEY, 3)
            ckpt.close()
            newest, older = store.snapshots(KEY)[:2]
            wait_for(lambda: parse_entries(api.annotations.get(JOB, {}).get(ANNOTATION),
                                           where="") == {(store.url, str(KEY)): newest.seq},
                     30, "the newest seq in the Job's annotation")
        finally:
            assert first.stop() == 0, first.stderr  # the pod is gone, and its volume
        store.raw_backend.delete(record_name(KEY.path, newest.seq))  # behind the key's back

        second = _pod(tmp_path, "pod-1", api, token, monkeypatch)
        try:
            assert f"earlier pods of Job ml/train committed {KEY} seq {newest.seq} (kept in " \
                "cairn.dev/committed-seqs)" in second.stderr
            with pytest.raises(RollbackRefused) as refused:
                committed_try(store, KEY, 1)
            assert (refused.value.recorded, refused.value.found) == (newest.seq, older.seq)
            assert "copied from the annotation cairn.dev/committed-seqs of Job ml/train" in \
                str(refused.value)
            assert store.snapshots(KEY)[0].seq == older.seq, "nothing was written"
        finally:
            assert second.stop() == 0, second.stderr

        # The same try in a pod whose sidecar did not seed it: the older snapshot restored.
        monkeypatch.setenv("CAIRN_COMMITTED_DIR", str(tmp_path / "unseeded"))
        ckpt, start = committed_try(store, KEY, 1)
        ckpt.close()
        assert start == older.manifest.step + 1
