"""Manifest parsing trusts nothing: paths, sizes, digests and the schema are all checked.

Most cases are written in schema 1's JSON (one readable list per chunk), which cairn still
reads; schema 2 (written now) is checked at the end and in test_chunktable.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.store.chunktable import ChunkRef
from cairn.store.manifest import (
    MANIFEST_SCHEMA,
    MANIFEST_SCHEMA_V1,
    FileEntry,
    Manifest,
    SnapshotMode,
    manifest_from_json,
)

DIGEST = "ab" * 32


def good() -> dict[str, Any]:
    return {
        "schema": MANIFEST_SCHEMA_V1, "key": ["d", "t"], "seq": 3, "epoch": 1, "parent": 2,
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


def delta_manifest() -> Manifest:
    full = ChunkRef(DIGEST, 3 * 4096, "packs/aa/base", 8192)
    changed = ChunkRef("cd" * 32, 3 * 4096, "packs/bb/new", 0, "packs/aa/base", 8192, 0b010)
    return Manifest(key=("d", "t"), seq=4, epoch=2, parent=3, created_at="2026-12-01T00:00:00Z",
                    mode=SnapshotMode.PROCESS, metadata={},
                    files=(FileEntry("images/pages-1.img", 2 * 3 * 4096, (full, changed)),))


def test_schema_2_round_trips_delta_chunks_and_lists_their_base_packs() -> None:
    manifest = delta_manifest()
    doc = manifest.to_json()
    assert doc["schema"] == MANIFEST_SCHEMA
    assert doc["packs"] == ["packs/aa/base", "packs/bb/new"]
    assert isinstance(doc["files"][0]["chunks"], str)
    assert manifest_from_json(doc) == manifest
    assert manifest.packs() == {"packs/aa/base", "packs/bb/new"}


def test_a_schema_1_manifest_reads_as_it_was_written() -> None:
    manifest = manifest_from_json(good())
    assert manifest.file("dir/a.bin").chunks == (ChunkRef(DIGEST, 6, "packs/ab/p", 0),
                                                 ChunkRef(DIGEST, 4, "packs/ab/p", 6))
    assert manifest_from_json(manifest.to_json()) == manifest  # now written as schema 2


@pytest.mark.parametrize("packs, message", [
    (["../etc"], "bad pack"), ("packs/aa/x", "not a list"), ([7], "bad pack")])
def test_schema_2_pack_lists_are_checked(packs: object, message: str) -> None:
    doc = delta_manifest().to_json()
    doc["packs"] = packs
    with pytest.raises(CorruptSnapshot, match=message):
        manifest_from_json(doc)


def test_a_schema_2_table_naming_a_pack_past_the_list_is_rejected_when_first_read() -> None:
    doc = delta_manifest().to_json()
    doc["packs"] = doc["packs"][:1]
    manifest = manifest_from_json(doc, seq=4)  # tables are decoded at first use (ADR 0044)
    for _ in range(2):  # a table that failed is not remembered as good
        with pytest.raises(CorruptSnapshot, match="names pack 1 of 1") as err:
            list(manifest.chunk_refs())
        assert err.value.seq == 4
    with pytest.raises(CorruptSnapshot, match="names pack 1 of 1"):
        manifest.packs()


def test_a_schema_2_table_whose_chunks_do_not_add_up_is_rejected_when_first_read() -> None:
    doc = delta_manifest().to_json()
    doc["files"][0]["size"] += 4096
    manifest = manifest_from_json(doc, seq=4)
    with pytest.raises(CorruptSnapshot, match="add up to 24576 bytes, not 28672") as err:
        manifest.files[0].chunks
    assert err.value.seq == 4 and "manifest of seq 4 is invalid" in str(err.value)


@pytest.mark.parametrize("table, message", [(7, "not text"), ("!!", "not base64")])
def test_a_schema_2_table_that_is_not_base64_text(table: object, message: str) -> None:
    doc = delta_manifest().to_json()
    doc["files"][0]["chunks"] = table
    with pytest.raises(CorruptSnapshot, match=message):
        list(manifest_from_json(doc, seq=4).chunk_refs())


def test_a_file_entry_is_immutable_and_equal_by_its_chunks() -> None:
    manifest = delta_manifest()
    parsed = manifest_from_json(manifest.to_json())
    entry = parsed.files[0]
    assert "not decoded yet" in repr(entry)
    assert entry == manifest.files[0] and "2 chunks" in repr(entry)
    with pytest.raises(AttributeError, match="immutable"):
        entry.size = 1  # type: ignore[misc]


def test_pack_ends_cover_every_extent_and_the_manifest_still_copies() -> None:
    manifest = manifest_from_json(delta_manifest().to_json())
    # the full chunk ends at 8192 + 12288 in the base pack, the delta's one page at 4096
    assert manifest.pack_ends() == {"packs/aa/base": 8192 + 3 * 4096, "packs/bb/new": 4096}
    manifest.pack_ends()["packs/aa/base"] = 0  # a copy: the manifest's own stays
    assert manifest.pack_ends()["packs/aa/base"] == 8192 + 3 * 4096
    assert copy.deepcopy(manifest) == manifest
