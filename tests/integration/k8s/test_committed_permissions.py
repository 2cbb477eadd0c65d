"""The committed-seq files on the pod's shared volume (ADR 0049, ``cairn.k8s.committed``),
read and written by the pod's two users: the sidecar (uid and gid 65532) and a main container
of another user in the pod's ``fsGroup`` (65532, a supplementary group of every container).

As on a pod whose ``fsGroup`` is the sidecar's group: the volume's root belongs to group 65532
with the setgid bit (what the kubelet does to an ``emptyDir``, mode 2777). Real processes with
each identity: the sidecar creates the directory and seeds a record the main container then
reads and moves on; the records each writes there (0660, the directory being setgid) the other
reads; a user outside the group reads none. Needs root (to switch users).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cairn.k8s.committed import SHARED_DIR_MODE, SHARED_FILE_MODE
from cairn.k8s.transform import SIDECAR_UID
from cairn.runtime.rollback import MARK_FILE_MODE, local_mark
from tests.support.hang import HANG_S

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")

MAIN_UID = 1000  # a state-mode main container that is not root
STORE, KEY = "gs://bucket/cairn", "ml/train/0"
SOURCE = "the annotation cairn.dev/committed-seqs of Job ml/train"

SIDECAR = textwrap.dedent("""
    marks = SharedMarks(sys.argv[1])
    what = sys.argv[2]
    if what == "seed":
        marks.prepare()
        print(marks.record(STORE, KEY, 7, source=SOURCE))
    elif what == "upload":
        marks.record_commit(STORE, KEY, int(sys.argv[3]))
    print(json.dumps(sorted([list(k), v] for k, v in marks.scan().items())))
""")

MAIN = textwrap.dedent("""
    mark = local_mark(STORE, KEY, {"CAIRN_COMMITTED_DIR": sys.argv[1]})
    print(json.dumps([mark.read(), mark.record(int(sys.argv[2])), mark.read()]))
""")


def _as(uid: int, groups: list[int], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as ``uid`` with ``groups`` (the first its own). The interpreter and its
    imports load as root first (this venv may live where the others cannot read), then the
    identity drops before any file of the volume is touched."""
    prologue = ("import json, logging, os, sys\n"
                "from cairn.k8s.committed import SharedMarks\n"
                "from cairn.runtime.rollback import local_mark\n"
                f"STORE, KEY, SOURCE = {STORE!r}, {KEY!r}, {SOURCE!r}\n"
                f"os.setgroups({groups}); os.setgid({groups[0]}); os.setuid({uid})\n")
    return subprocess.run([sys.executable, "-c", prologue + code, *args], cwd="/",
                          capture_output=True, text=True, timeout=HANG_S)


def _json(done: subprocess.CompletedProcess[str]) -> object:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pods_two_users_share_the_committed_seqs(volume: Path) -> None:
    directory = volume / "committed"
    mark_path = Path(local_mark(STORE, KEY, {"CAIRN_COMMITTED_DIR": str(directory)}).path)
    sidecar = [SIDECAR_UID]
    main = [MAIN_UID, SIDECAR_UID]  # its own group, and the pod's fsGroup

    # Before the main container starts: the sidecar's directory and the seeded record.
    assert _json(_as(SIDECAR_UID, sidecar, SIDECAR, str(directory), "seed")) == [
        [[STORE, KEY], 7]]
    st = directory.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (SIDECAR_UID, SIDECAR_UID,
                                                                  SHARED_DIR_MODE)
    st = mark_path.stat()
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (SIDECAR_UID, SHARED_FILE_MODE)

    # The main container reads the seed (the floor of its try) and records its own commit,
    # in the group-shared directory readable by the pod's group (not 0600)...
    assert _json(_as(MAIN_UID, main, MAIN, str(directory), "9")) == [7, True, 9]
    st = mark_path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (MAIN_UID, SIDECAR_UID,
                                                                  SHARED_FILE_MODE)
    assert SHARED_FILE_MODE != MARK_FILE_MODE
    # ...so the sidecar, another user, reads it and keeps it in the Job.
    scanned = _as(SIDECAR_UID, sidecar, SIDECAR, str(directory), "scan")
    assert _json(scanned) == [[[STORE, KEY], 9]]
    assert "cannot read" not in scanned.stderr

    # Process mode: the sidecar records what it uploads, before the main container hears of
    # it; the main container's record of the same seq then changes nothing, and the record
    # stays the sidecar's, readable by both.
    assert _json(_as(SIDECAR_UID, sidecar, SIDECAR, str(directory), "upload", "10")) == [
        [[STORE, KEY], 10]]
    assert _json(_as(MAIN_UID, main, MAIN, str(directory), "10")) == [10, False, 10]
    st = mark_path.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (SIDECAR_UID, SHARED_FILE_MODE)
    assert _json(_as(SIDECAR_UID, sidecar, SIDECAR, str(directory), "scan")) == [
        [[STORE, KEY], 10]]

    # A user outside the pod's group sees none of it.
    stranger = _as(SIDECAR_UID + 1, [SIDECAR_UID + 1], MAIN, str(directory), "11")
    assert stranger.returncode != 0 and "PermissionError" in stranger.stderr
