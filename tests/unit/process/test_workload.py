"""What ``/proc`` says about a live process: this test's own process, which opens the files
and connections itself."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from cairn.process import workload


def test_files_are_classified(tmp_path: Path) -> None:
    me = [os.getpid()]
    with open(tmp_path / "in-place.txt", "w") as rewritten, \
            open(tmp_path / "log.txt", "a") as appended, \
            open(tmp_path / "read.txt", "w+") as _unused_rw:
        (tmp_path / "gone.txt").write_text("x")
        deleted = open(tmp_path / "gone.txt", "w")
        os.unlink(tmp_path / "gone.txt")
        try:
            files = workload.open_files(me)
            problems = workload.rewritten_files(files, ignore={str(tmp_path / "read.txt")})
            named = [p.what for p in problems]
            assert any(str(tmp_path / "in-place.txt") in w for w in named)
            assert not any("gone.txt" in w for w in named), "deleted files are CRIU's ghosts"
            assert not any("read.txt" in w for w in named), "ignored"
            assert all("mode 'a'" in p.fix for p in problems)
            assert str(tmp_path / "log.txt") in workload.append_files(files)
        finally:
            deleted.close()
        assert rewritten and appended


def test_established_tcp_is_named_listening_is_not() -> None:
    me = [os.getpid()]
    # The suite's own process may hold connections already (to the GCS test server).
    before = {p.what for p in workload.established_tcp(workload.open_files(me))}
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    assert {p.what for p in workload.established_tcp(workload.open_files(me))} == before
    client = socket.create_connection(("127.0.0.1", port))
    peer, _ = server.accept()
    try:
        problems = [p for p in workload.established_tcp(workload.open_files(me))
                    if p.what not in before]
        text = " ".join(p.what for p in problems)
        assert f"-> 127.0.0.1:{port}" in text  # the client's side
        assert f"127.0.0.1:{port} ->" in text  # the accepted side
        assert "torchrun" in problems[0].fix
    finally:
        client.close()
        peer.close()
        server.close()


def test_tree_and_memory_of_self() -> None:
    tree = workload.process_tree(os.getpid())
    assert tree[0] == os.getpid()
    assert workload.resident_bytes([os.getpid()]) > 1 << 20
    assert workload.gpu_pids([os.getpid()]) == []
