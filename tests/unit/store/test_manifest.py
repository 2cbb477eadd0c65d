"""Manifest parsing trusts nothing: paths, sizes, digests and the schema are all checked."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store.manifest import MANIFEST_SCHEMA, SnapshotMode, manifest_from_json

DIGEST = "ab" * 32


def good() -> dict[str, Any]:
    return {
        "schema": MANIFEST_SCHEMA, "key": ["d", "t"], "seq": 3, "epoch": 1, "parent": 2,
        "created_at": "2026-11-29T00:00:00.000000Z", "mode": "files",
        "files": [{"path": "dir/a.bin", "size": 10, "mode": 0o644,
                   "chunks": [[DIGEST, 6, "packs/ab/p", 0], [DIGEST, 4, "packs/ab/p", 6]]}],
        "metadata": {"step": 7, "bytes_written": 10},
    }


def test_round_trip() -> None:
    manifest = manifest_from_json(good())
    assert manifest.mode is SnapshotMode.FILES
    assert manifest.bytes_logical == 10 and manifest.step == 7
    assert manifest_from_json(manifest.to_json()) == manifest


def mutate(path: list[object], value: object) -> dict[str, Any]:
    doc = copy.deepcopy(good())
    target: Any = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    "doc, message",
    [
        (mutate(["files", 0, "path"], "../etc/passwd"), "'..'"),
        (mutate(["files", 0, "path"], "/etc/passwd"), "absolute"),
        (mutate(["files", 0, "path"], "a//b"), "empty"),
        (mutate(["files", 0, "path"], "a\x00b"), "NUL"),
        (mutate(["schema"], "cairn.manifest/99"), "upgrade cairn"),
        (mutate(["files", 0, "size"], 1 << 60), "out of range"),
        (mutate(["files", 0, "size"], -1), "out of range"),
        (mutate(["files", 0, "size"], 11), "add up"),
        (mutate(["files", 0, "chunks", 0, 1], 1 << 40), "out of range"),
        (mutate(["files", 0, "chunks", 0, 0], "zz"), "bad digest"),
        (mutate(["files", 0, "chunks", 0, 2], "../../etc/x"), "bad pack"),
        (mutate(["files", 0, "size"], True), "not an integer"),
        (mutate(["mode"], "bogus"), "bogus"),
        ("not a dict", "not a JSON object"),
    ],
)
def test_invalid_manifests_are_rejected_with_a_reason(doc: object, message: str) -> None:
    with pytest.raises(CorruptSnapshot) as err:
        manifest_from_json(doc, seq=3)
    assert message in str(err.value)
    assert err.value.seq == 3


def test_duplicate_paths_are_rejected() -> None:
    doc = good()
    doc["files"].append(copy.deepcopy(doc["files"][0]))
    with pytest.raises(CorruptSnapshot, match="twice"):
        manifest_from_json(doc)
