"""Which shared-memory files a restore puts back: torch's, held open by the dump, missing
now (the real-CRIU case is in tests/integration/process/test_criu_dump_restore.py)."""

from __future__ import annotations

from pathlib import Path

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
