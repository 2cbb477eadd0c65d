"""Which shared-memory files a restore puts back: torch's, held open and still linked at the
dump, missing now, fitting in /dev/shm (the real-CRIU case is in tests/integration/process/test_criu_dump_restore.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cairn.exceptions import RestoreFailed
from cairn.process import images as I
from cairn.process import torch_shm
from tests.support.fake_dump import field, image


def test_only_torch_files_held_open_are_recreated(tmp_path: Path) -> None:
    """Files torch maps but does not hold open (``file_system`` sharing keeps them linked, with
    data) and other names are left alone: zeros would be wrong for them."""
    def reg(ident: int, name: str, size: int) -> bytes:
        body = field(1, ident) + field(2, 0o2) + field(3, 0) + field(6, name.encode()) + field(8, size)
        return field(1, I.FD_TYPE_REG) + field(2, ident) + field(3, body)

    image(tmp_path / "files.img", I.FILES_MAGIC, [
        reg(1, "/dev/shm/torch_1_2_3", 8192),        # held open: recreated
        reg(2, "/dev/shm/torch_1_2_4", 4096),        # only mapped
        reg(3, "/dev/shm/other_1", 4096),            # held open, not torch's
        reg(4, "/dev/shm/torch_1_2_5", 4096),        # held open, still exists
    ])
    image(tmp_path / "fdinfo-2.img", I.FDINFO_MAGIC,
          [field(1, i) + field(2, 0) + field(3, I.FD_TYPE_REG) + field(4, 10 + i) for i in (1, 3, 4)])
    root = tmp_path / "root"
    (root / "dev" / "shm").mkdir(parents=True)
    (root / "dev" / "shm" / "torch_1_2_5").write_bytes(b"data")
    made = torch_shm.recreate(tmp_path, root=str(root))
    assert made == [str(root / "dev" / "shm" / "torch_1_2_3")]
    assert (root / "dev" / "shm" / "torch_1_2_3").read_bytes() == bytes(8192)
    assert (root / "dev" / "shm" / "torch_1_2_5").read_bytes() == b"data"
    torch_shm.remove(made)
    assert not (root / "dev" / "shm" / "torch_1_2_3").exists()


def held_torch_files(where: Path, sizes: dict[int, int]) -> None:
    """A dump holding ``/dev/shm/torch_1_2_<id>`` open for each id, at the given sizes."""
    def reg(ident: int, size: int) -> bytes:
        body = field(1, ident) + field(2, 0o2) + field(3, 0) + \
            field(6, f"/dev/shm/torch_1_2_{ident}".encode()) + field(8, size)
        return field(1, I.FD_TYPE_REG) + field(2, ident) + field(3, body)

    image(where / "files.img", I.FILES_MAGIC, [reg(i, size) for i, size in sizes.items()])
    image(where / "fdinfo-2.img", I.FDINFO_MAGIC,
          [field(1, i) + field(2, 0) + field(3, I.FD_TYPE_REG) + field(4, 10 + i) for i in sizes])


def test_files_unlinked_at_the_dump_are_left_to_criu(tmp_path: Path) -> None:
    """A worker that had already unlinked its file holds a ghost, which CRIU restores under a
    name of its own: a copy at the old path would never be unlinked (issue 34)."""
    held_torch_files(tmp_path, {1: 4096, 2: 4096, 3: 4096, 4: 4096})
    image(tmp_path / "remap-fpath.img", I.REMAP_FPATH_MAGIC, [
        field(1, 1) + field(2, 101) + field(3, I.REMAP_TYPE_GHOST),
        field(1, 2) + field(2, 102) + field(3, I.REMAP_TYPE_LINKED),
        field(1, 3) + field(2, 103 | (1 << 31)),  # an older CRIU: the ghost bit in remap_id
    ])
    assert I.read_unlinked_file_ids(tmp_path) == {1, 2, 3}
    root = tmp_path / "root"
    (root / "dev" / "shm").mkdir(parents=True)
    made = torch_shm.recreate(tmp_path, root=str(root))
    assert made == [str(root / "dev" / "shm" / "torch_1_2_4")]
    assert sorted(p.name for p in (root / "dev" / "shm").iterdir()) == ["torch_1_2_4"]


def test_sizes_beyond_the_free_space_of_dev_shm_are_refused_making_nothing(tmp_path: Path
                                                                            ) -> None:
    """Sizes come from the image: together they must fit where the files go (a forged image,
    or a pod whose /dev/shm is smaller than the dumped host's)."""
    held_torch_files(tmp_path, {1: 4096, 2: 1 << 60})
    root = tmp_path / "root"
    (root / "dev" / "shm").mkdir(parents=True)
    with pytest.raises(RestoreFailed, match=r"2 shared-memory file\(s\).*larger /dev/shm"):
        torch_shm.recreate(tmp_path, root=str(root))
    assert list((root / "dev" / "shm").iterdir()) == []
