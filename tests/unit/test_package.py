"""The top-level package: ``cairn.Checkpointer`` as the issue's API spells it, without
importing torch for users of the store or the CLI alone."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_cairn_does_not_import_torch() -> None:
    code = "import sys, cairn; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_checkpointer_is_reachable_from_the_top() -> None:
    import cairn
    from cairn.state.checkpointer import Checkpointer

    assert cairn.Checkpointer is Checkpointer
    assert "Checkpointer" in cairn.__all__
    with pytest.raises(AttributeError, match="no attribute 'Checkpointr'"):
        cairn.Checkpointr  # noqa: B018 - the lookup is the test


def test_every_public_name_resolves_to_its_definition() -> None:
    import importlib

    import cairn

    for name, module in cairn._PUBLIC.items():
        assert getattr(cairn, name) is getattr(importlib.import_module(module), name), name
    assert set(cairn.__all__) == {*cairn._PUBLIC, "__version__"}


def test_the_store_api_does_not_import_torch_or_a_cloud_client() -> None:
    code = ("import sys, cairn; cairn.open_store; cairn.Key; cairn.ResumePolicy; cairn.Try; "
            "print(sorted(m for m in ('torch', 'google.cloud.storage') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cairn_run_on_a_plain_store_does_not_import_what_it_does_not_use(tmp_path) -> None:  # noqa: ANN001
    """``cairn run``'s path up to a restore (the CLI, the supervisor, the restore, a local
    store opened and listed) leaves ``cryptography`` unimported (only an encrypted store needs
    it; its import cost 20-45 ms of the time before a restore starts), nor ``statistics`` (a
    GPU budget's median; with ``decimal`` 7 ms of a cold start, ADR 0044), nor ``hashlib``
    (OpenSSL's library: ~20 ms from a cold disk; the committed-seq mark is named with BLAKE3)."""
    code = ("import sys; import cairn.cli.entry, cairn.process.host_start, cairn.cli.main, "
            "cairn.process.supervisor, cairn.process.restore, cairn.runtime.rollback as r; "
            "from cairn import open_store, Key; "
            f"s = open_store({str(tmp_path / 'store')!r}); s.snapshots(Key.parse('a/b')); "
            "r.local_mark(s.url, 'a/b'); "
            "print(sorted(m for m in ('cryptography', 'statistics', 'hashlib', '_hashlib') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
