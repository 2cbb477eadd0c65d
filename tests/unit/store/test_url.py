"""Store URLs: each accepted form picks its backend; anything else is a clear error."""

from __future__ import annotations

import os

import pytest

from cairn.exceptions import ConfigError, UnsupportedFilesystem
from cairn.store.local import LocalBackend, check_filesystem, filesystem_type
from cairn.store.url import open_backend


def test_path_and_file_url_are_local(tmp_path) -> None:
    a = open_backend(str(tmp_path / "a"))
    b = open_backend(f"file://{tmp_path}/b")
    assert isinstance(a, LocalBackend) and isinstance(b, LocalBackend)
    assert b.root == os.fspath(tmp_path / "b")


@pytest.mark.parametrize(
    "url, message",
    [
        ("", "empty store URL"),
        ("ftp://bucket/x", "unsupported store URL scheme 'ftp'"),
        ("s3://Bucket/x", "is not a bucket name"),
        ("gs://", "has no bucket"),
        ("gs:///prefix", "has no bucket"),
        ("file://otherhost/x", "names host"),
        ("file://", "has no path"),
        ("gs://bucket/p?x=1", "query"),
        ("bucket:path", "cannot parse"),
    ],
)
def test_malformed_urls_name_the_accepted_forms(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_backend(url)
    assert message in str(err.value)
    if "scheme" in message or "parse" in message:
        assert "gs://BUCKET/PREFIX" in str(err.value)


def test_store_path_that_is_a_file(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        open_backend(str(tmp_path / "f"))


def test_filesystem_type_reads_mountinfo(tmp_path) -> None:
    assert filesystem_type(str(tmp_path)) not in ("", "unknown")
    check_filesystem(str(tmp_path))  # the test machine's disk is accepted


def test_nfs_and_fuse_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for fs in ("nfs4", "fuse.gcsfuse"):
        monkeypatch.setattr("cairn.store.local.filesystem_type", lambda path, fs=fs: fs)
        with pytest.raises(UnsupportedFilesystem, match="gs://"):
            LocalBackend(str(tmp_path / "s"))


@pytest.mark.parametrize("kind", ["file", "gs", "s3"])
def test_canonical_url_is_what_the_opened_backend_names(kind: str, request: pytest.FixtureRequest,
                                                         tmp_path, monkeypatch) -> None:
    """Records kept outside a store (the committed-seq marks) are filed under its canonical
    URL before it is opened; each spelling must give the name the opened backend uses."""
    from cairn.store.url import canonical_url

    if kind == "file":
        monkeypatch.chdir(tmp_path)
        spellings = ["rel/store", f"{tmp_path}/rel/store/", f"file://{tmp_path}/rel/store",
                     f"file://localhost{tmp_path}/rel/./store"]
    else:
        fixture = "gcs_bucket" if kind == "gs" else "s3_bucket"
        bucket = request.getfixturevalue(fixture)
        spellings = [f"{kind}://{bucket}/a/b", f" {kind}://{bucket}//a/b/ ", f"{kind}://{bucket}",
                     f"{kind}://{bucket}/"]
    for url in spellings:
        backend = open_backend(url)
        try:
            assert canonical_url(url) == backend.url, url
        finally:
            backend.close()
