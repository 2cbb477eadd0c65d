"""Issue 15: the spool is readable by the pod's two containers only.

As on a pod whose ``fsGroup`` is the sidecar's group: the shared volume's root belongs to group
65532 with the setgid bit (what the kubelet does to an ``emptyDir``, mode 2777). The supervisor
(root, here this test) spools a dump; then real processes with the sidecar's identity (uid and
gid 65532) and a stranger's (uid 65533, not in the group) try to take it. The sidecar reads the
ticket and every file, writes its result and deletes the entry; the stranger cannot even list
the spool. Needs root (to switch users).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cairn.k8s.transform import SIDECAR_UID
from cairn.process.spool import Spool
from cairn.store import Key
from tests.support.fake_dump import fake_dump
from tests.support.hang import HANG_S

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")

STRANGER = SIDECAR_UID + 1

TAKE = textwrap.dedent("""
    import json, os, sys
    from cairn.process.spool import Spool
    spool = Spool(sys.argv[1])
    entry = spool.pending()[0]
    ticket = spool.read_ticket(entry)
    sizes = {}
    for root, _dirs, files in os.walk(spool.entry_path(entry)):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                sizes[os.path.relpath(os.path.join(root, name), spool.path)] = len(f.read())
    print(json.dumps({"entry": entry, "key": ticket.key, "files": sizes}))
""")

STRANGE = textwrap.dedent("""
    import os, sys
    denied = []
    for attempt in (lambda: os.listdir(sys.argv[1]),
                    lambda: open(os.path.join(sys.argv[1], sys.argv[2], "ticket.json")).read(),
                    lambda: open(os.path.join(sys.argv[1], "new-file"), "w")):
        try:
            attempt()
        except PermissionError:
            denied.append(True)
    print(len(denied))
""")


def _as(uid: int, gid: int, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as ``uid``/``gid`` (and in no other group). The interpreter and its imports
    load as root first (this venv's Python lives under /root), then the identity drops before
    any spool access, so every check below is the kernel's for that user."""
    prologue = ("import json, os, sys\n"
                "import cairn.process.spool\n"
                f"os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})\n")
    return subprocess.run([sys.executable, "-c", prologue + code, *args], cwd="/",
                          capture_output=True, text=True, timeout=HANG_S)


def test_the_sidecar_takes_the_entry_and_nobody_else_can_look(volume: Path) -> None:
    spool = Spool(str(volume / "spool"))
    log = volume / "stdout.log"
    log.write_bytes(b"step 1\nstep 2\n")
    entry = spool.new_entry(3)
    fake_dump(spool.images_dir(entry), appended={str(log): 7})
    spool.hand_off(entry, key=Key.parse("dag/train/run-1"), store="gs://bucket/cairn", epoch=3,
                   last_seq=3, parent_seq=None, compat={"argv": ["python", "train.py"]},
                   info={}, tracked_paths=[str(log)])

    for root, dirs, files in os.walk(spool.path):
        for name in [*dirs, *files, "."]:
            st = os.stat(os.path.join(root, name))
            assert st.st_gid == SIDECAR_UID, (root, name)  # the volume's group, through setgid
            assert stat.S_IMODE(st.st_mode) & 0o007 == 0, (root, name, oct(st.st_mode))

    stranger = _as(STRANGER, STRANGER, STRANGE, spool.path, entry)
    assert stranger.returncode == 0, stranger.stderr
    assert stranger.stdout.strip() == "3", "listing, reading and creating must all be refused"

    sidecar = _as(SIDECAR_UID, SIDECAR_UID, TAKE, spool.path)
    assert sidecar.returncode == 0, sidecar.stderr
    assert f'"entry": "{entry}"' in sidecar.stdout
    assert '"files/0": 7' in sidecar.stdout.replace(f"{entry}/", "")  # the log up to the dump

    # The uploader's own writes: its verdict, then the entry deleted (ADR 0014).
    finish = textwrap.dedent("""
        import sys
        from cairn.process.spool import Result, Spool, UploadOutcome
        spool = Spool(sys.argv[1])
        spool.write_result(Result(sys.argv[2], UploadOutcome.COMMITTED, 3, seq=4))
        spool.remove(sys.argv[2])
        print(spool.entries())
    """)
    done = _as(SIDECAR_UID, SIDECAR_UID, finish, spool.path, entry)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert [r.entry for r in spool.results()] == [entry]
