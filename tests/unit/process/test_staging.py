"""Where a dump stages: the headroom from a fake cgroup tree (a directory standing in for
``/proc`` and ``/sys``, named a fake), the filesystem from a fake mountinfo, the choice; the
memory directory held by a live run (a real process holding a real flock) and swept once
its run was killed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.exceptions import ConfigError
from cairn.process.staging import (
    HELD_MARK,
    Headroom,
    StagingMedium,
    choose_staging,
    filesystem_type,
    hold_private_dir,
    memory_headroom,
    memory_headroom_bytes,
    memory_parent,
    on_memory,
    page_cache_room,
    prepare_private_dir,
    remove_abandoned,
    remove_private_dir,
)

GiB = 1 << 30
CGROUP = "/kubepods/pod1/main"


def fake_host(root: Path, *, limit: str | None, usage: int, inactive_file: int = 0,
              available: int = 20 * GiB, v1: bool = False, mounts: str = "") -> Path:
    """A fake ``/proc`` and ``/sys/fs/cgroup`` under ``root`` for a process in ``CGROUP``
    (cgroup v2, or v1 with ``v1``); ``limit`` None leaves the limit file out, as the root
    cgroup has none."""
    proc = root / "proc" / "self"
    proc.mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: {64 * GiB // 1024} kB\n"
                                           f"MemAvailable: {available // 1024} kB\n")
    if v1:
        (proc / "mounts").write_text("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n")
        (proc / "cgroup").write_text(f"4:memory:{CGROUP}\n")
        base = root / "sys" / "fs" / "cgroup" / "memory" / CGROUP.lstrip("/")
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    else:
        (proc / "mounts").write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n")
        (proc / "cgroup").write_text(f"0::{CGROUP}\n")
        base = root / "sys" / "fs" / "cgroup" / CGROUP.lstrip("/")
        names = ("memory.max", "memory.current", "inactive_file")
    base.mkdir(parents=True)
    if limit is not None:
        (base / names[0]).write_text(f"{limit}\n")
    (base / names[1]).write_text(f"{usage}\n")
    (base / "memory.stat").write_text(f"anon {usage}\n{names[2]} {inactive_file}\n")
    (proc / "mountinfo").write_text(mounts)
    return root


def test_the_cgroup_limit_less_the_working_set_is_the_headroom(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "fake", limit=str(8 * GiB), usage=5 * GiB, inactive_file=GiB)
    room = memory_headroom(None, root=str(root))
    # Reclaimable page cache (inactive_file) is not held against the step.
    assert room.cgroup_bytes == 4 * GiB and room.available_bytes == 20 * GiB
    assert room.bytes == 4 * GiB and room.limited_by == "the memory cgroup's limit"
    assert memory_headroom_bytes(None, root=str(root)) == 4 * GiB


def test_cgroup_v1_is_read_too(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "fake", limit=str(6 * GiB), usage=2 * GiB, v1=True)
    assert memory_headroom_bytes(None, root=str(root)) == 4 * GiB


def test_no_limit_leaves_mem_available(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "fake", limit="max", usage=5 * GiB, available=3 * GiB)
    room = memory_headroom(None, root=str(root))
    assert room.cgroup_bytes is None and room.bytes == 3 * GiB
    assert room.limited_by == "MemAvailable"


def test_mem_available_bounds_a_generous_limit(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "fake", limit=str(100 * GiB), usage=GiB, available=2 * GiB)
    assert memory_headroom_bytes(None, root=str(root)) == 2 * GiB


def test_the_tmpfs_free_space_bounds_it(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "fake", limit="max", usage=GiB, available=1 << 50)
    shm = tmp_path / "shm"
    shm.mkdir()
    before = os.statvfs(shm)
    room = memory_headroom(str(shm / "cairn-run" / "not-made-yet"), root=str(root))
    after = os.statvfs(shm)
    # Other processes write to the same filesystem meanwhile (tests in parallel, a bench).
    free = sorted(v.f_bavail * v.f_frsize for v in (before, after))
    assert room.tmpfs_free_bytes is not None
    assert free[0] - (64 << 20) <= room.tmpfs_free_bytes <= free[1] + (64 << 20)
    assert room.bytes == room.tmpfs_free_bytes and room.limited_by == "the tmpfs's free space"


def test_an_unreadable_host_has_no_headroom(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert memory_headroom(None, root=str(tmp_path / "empty")) == Headroom(None, None, None)
    assert memory_headroom_bytes(None, root=str(tmp_path / "empty")) == 0


def mountinfo(*mounts: tuple[str, str]) -> str:
    return "".join(f"{20 + i} 1 0:{i} / {point} rw,relatime shared:{i} - {kind} {kind} rw\n"
                   for i, (point, kind) in enumerate(mounts))


def test_filesystem_type_takes_the_longest_mount_holding_the_path(tmp_path: Path) -> None:
    run = tmp_path / "run dir"
    root = fake_host(tmp_path / "fake", limit=None, usage=0, mounts=mountinfo(
        ("/", "ext4"), (str(tmp_path).replace(" ", "\\040"), "xfs"),
        (str(run).replace(" ", "\\040"), "tmpfs")))
    assert filesystem_type(str(run / "staging" / "dump-1"), root=str(root)) == "tmpfs"
    assert on_memory(str(run), root=str(root))
    assert filesystem_type(str(tmp_path / "run"), root=str(root)) == "xfs"  # a prefix, not a parent
    assert not on_memory("/usr/lib", root=str(root))
    assert filesystem_type("/usr", root=str(tmp_path / "nothing")) is None


def test_the_memory_directory_is_the_run_dir_when_that_is_tmpfs(tmp_path: Path) -> None:
    run = tmp_path / "run" / "0123abcd"
    disk = str(run / "staging")
    on_disk = fake_host(tmp_path / "a", limit=None, usage=0, mounts=mountinfo(("/", "ext4")))
    assert memory_parent(str(run), disk, root=str(on_disk)) == "/dev/shm/cairn-0123abcd"
    assert memory_parent(str(run), disk, shm_dir="/x", root=str(on_disk)) == "/x/cairn-0123abcd"
    in_memory = fake_host(tmp_path / "b", limit=None, usage=0,
                          mounts=mountinfo(("/", "ext4"), (str(tmp_path / "run"), "tmpfs")))
    assert memory_parent(str(run), disk, root=str(in_memory)) == disk


ROOM = Headroom(cgroup_bytes=12 * GiB, available_bytes=20 * GiB, tmpfs_free_bytes=30 * GiB)


def choose(policy: StagingMedium, image: int | None, *, estimate: int | None = None,
           room: Headroom = ROOM, page_cache: int = 0):
    # page_cache 0: the disk's page cache would throttle any dump (memory is then the question)
    return choose_staging(policy, image_bytes=image, estimate_bytes=estimate,
                          memory_dir="/dev/shm/cairn-r", disk_dir="/work/r/staging",
                          headroom=room, page_cache=page_cache)


def test_auto_stays_on_disk_while_the_page_cache_takes_the_dump_unthrottled() -> None:
    cached = choose(StagingMedium.AUTO, GiB, page_cache=2 * GiB)
    assert (cached.parent, cached.medium) == ("/work/r/staging", StagingMedium.DISK)
    assert "page cache takes 2.0 GiB" in cached.reason
    assert choose(StagingMedium.AUTO, 2 * GiB, page_cache=2 * GiB).medium is StagingMedium.MEMORY
    # Forced memory is memory, whatever the page cache could take.
    assert choose(StagingMedium.MEMORY, GiB, page_cache=8 * GiB).medium is StagingMedium.MEMORY


def test_page_cache_room_is_the_free_run_point_less_what_is_dirty(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "fake", limit=str(100 * GiB), usage=0)
    vm = root / "proc" / "sys" / "vm"
    vm.mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(
        f"MemFree: {8 * GiB // 1024} kB\nActive(file): {GiB // 1024} kB\n"
        f"Inactive(file): {GiB // 1024} kB\nDirty: {GiB // 4 // 1024} kB\n"
        f"Writeback: {GiB // 4 // 1024} kB\n")
    for name, value in (("dirty_ratio", 20), ("dirty_background_ratio", 10),
                        ("dirty_bytes", 0), ("dirty_background_bytes", 0)):
        (vm / name).write_text(f"{value}\n")
    # (20% + 10%) / 2 of 10 GiB dirtyable, less 0.5 GiB dirty or under writeback.
    assert page_cache_room(root=str(root)) == 10 * GiB * 15 // 100 - GiB // 2
    (vm / "dirty_bytes").write_text(f"{4 * GiB}\n")
    (vm / "dirty_background_bytes").write_text(f"{2 * GiB}\n")
    assert page_cache_room(root=str(root)) == 3 * GiB - GiB // 2
    # A memory cgroup's writeback is limited against its own memory.
    (vm / "dirty_bytes").write_text("0\n")
    (vm / "dirty_background_bytes").write_text("0\n")
    small = Headroom(cgroup_bytes=2 * GiB, available_bytes=None, tmpfs_free_bytes=None)
    assert page_cache_room(headroom=small, root=str(root)) == 0  # 0.3 GiB < 0.5 GiB dirty
    assert page_cache_room(root=str(tmp_path / "nothing")) is None


def test_auto_stages_in_memory_when_the_headroom_covers_1_2_images() -> None:
    fits = choose(StagingMedium.AUTO, 10 * GiB)
    assert (fits.parent, fits.medium) == ("/dev/shm/cairn-r", StagingMedium.MEMORY)
    assert "12.0 GiB" in fits.reason and "the last image 10.0 GiB" in fits.reason
    short = choose(StagingMedium.AUTO, 10 * GiB + 1)  # 1.2 x that is just over 12 GiB
    assert (short.parent, short.medium) == ("/work/r/staging", StagingMedium.DISK)
    assert "<" in short.reason and "the memory cgroup's limit" in short.reason


def test_auto_sizes_the_first_dump_by_the_estimate_and_without_one_goes_to_disk() -> None:
    first = choose(StagingMedium.AUTO, None, estimate=GiB)
    assert first.medium is StagingMedium.MEMORY and "the resident memory" in first.reason
    assert choose(StagingMedium.AUTO, None, estimate=11 * GiB).medium is StagingMedium.DISK
    assert choose(StagingMedium.AUTO, None).medium is StagingMedium.DISK
    # The last image, once there is one, decides (not the estimate).
    assert choose(StagingMedium.AUTO, GiB, estimate=100 * GiB).medium is StagingMedium.MEMORY


def test_forced_media_are_kept_and_a_short_headroom_is_said() -> None:
    assert choose(StagingMedium.DISK, GiB).parent == "/work/r/staging"
    forced = choose(StagingMedium.MEMORY, 20 * GiB)
    assert forced.medium is StagingMedium.MEMORY and forced.parent == "/dev/shm/cairn-r"
    assert "out of memory" in forced.reason
    assert "out of memory" not in choose(StagingMedium.MEMORY, GiB).reason


def test_the_headroom_is_measured_for_the_memory_directory_when_not_given(
        tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    choice = choose_staging(StagingMedium.MEMORY, image_bytes=1 << 20,
                            memory_dir=str(shm / "c"), disk_dir=str(tmp_path / "disk"),
                            root=str(fake_host(tmp_path / "fake", limit=str(2 << 20),
                                               usage=1 << 20)))
    assert "headroom 1.0 MiB" in choice.reason and "out of memory" in choice.reason
    # AUTO also measures the page cache: the fake host's meminfo has no free memory to dirty.
    auto = choose_staging(StagingMedium.AUTO, image_bytes=1 << 20, memory_dir=str(shm / "c"),
                          disk_dir=str(tmp_path / "disk"), root=str(tmp_path / "fake"))
    assert auto.medium is StagingMedium.DISK and "1.0 MiB" in auto.reason


def test_staging_text_is_parsed_with_the_choices_named() -> None:
    assert StagingMedium.parse("memory") is StagingMedium.MEMORY
    assert StagingMedium.parse(StagingMedium.DISK) is StagingMedium.DISK
    with pytest.raises(ConfigError, match="'tmpfs' is not one of 'auto', 'memory', 'disk'"):
        StagingMedium.parse("tmpfs", source="--staging")


def test_the_private_directory_is_made_0700_and_emptied_of_a_killed_runs_leftovers(
        tmp_path: Path) -> None:
    where = tmp_path / "cairn-r"
    prepare_private_dir(str(where))
    assert where.stat().st_mode & 0o777 == 0o700
    (where / "dump-1").mkdir()
    (where / "dump-1" / "pages-1.img").write_bytes(b"x")
    (where / "stray").write_bytes(b"y")
    where.chmod(0o755)
    prepare_private_dir(str(where))
    assert list(where.iterdir()) == [] and where.stat().st_mode & 0o777 == 0o700


def test_a_planted_name_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    planted = tmp_path / "cairn-r"
    planted.symlink_to(target)
    with pytest.raises(ConfigError, match="--staging disk"):
        prepare_private_dir(str(planted))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory of this user"):
        prepare_private_dir(str(tmp_path / "file"))
    assert target.exists() and list(target.iterdir()) == []
    remove_private_dir(str(planted))  # not this run's: left alone
    assert planted.is_symlink() and target.is_dir()


def test_removing_the_private_directory(tmp_path: Path) -> None:
    where = tmp_path / "cairn-r"
    remove_private_dir(str(where))  # never made: nothing to do
    prepare_private_dir(str(where))
    (where / "dump-1").mkdir()
    remove_private_dir(str(where))
    assert not where.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "cairn-r"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match="not a directory of this user"):
        prepare_private_dir(str(theirs))
    remove_private_dir(str(theirs))
    assert theirs.is_dir()


def test_run_settings_and_cairn_run_refuse_an_unknown_medium(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cairn.cli.main import main
    from cairn.process.supervisor import RunSettings
    from cairn.runtime.env import STAGING

    with pytest.raises(ConfigError, match="StagingMedium.parse"):
        RunSettings(store="/s", key="k", argv=("true",), staging="memory")  # type: ignore[arg-type]
    assert RunSettings(store="/s", key="k", argv=("true",)).staging is StagingMedium.AUTO
    run = ["run", "--store", str(tmp_path / "s"), "--key", "k"]
    assert main([*run, "--staging", "tmpfs", "--", "true"]) == 2
    assert "--staging (or $CAIRN_STAGING) 'tmpfs' is not one of 'auto', 'memory', 'disk'" in \
        capsys.readouterr().err
    monkeypatch.setenv(STAGING.name, "ram")
    assert main([*run, "--", "true"]) == 2
    assert "'ram' is not one of" in capsys.readouterr().err


# -- holding the memory directory, and what killed runs left ----------------------------------

HOLDER = """
import sys, time
from cairn.process.staging import hold_private_dir
hold_private_dir(sys.argv[1])
with open(sys.argv[1] + "/dump-1", "wb") as f:
    f.write(b"x" * 8192)
print("held", flush=True)
time.sleep(120)
"""


def start_holder(path: Path) -> subprocess.Popen[str]:
    """A process standing in for a live ``cairn run`` that stages in ``path``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_held_directory_is_marked_and_a_second_hold_names_the_fix(tmp_path: Path) -> None:
    where = tmp_path / "cairn-r"
    where.mkdir(mode=0o755)
    (where / "stray").write_bytes(b"a killed run's")
    fd = hold_private_dir(str(where))
    try:
        assert sorted(p.name for p in where.iterdir()) == [HELD_MARK], "leftovers removed"
        assert where.stat().st_mode & 0o777 == 0o700
        assert not os.get_inheritable(fd), "CRIU and the workload must not hold it"
        with pytest.raises(ConfigError, match="another live cairn run holds it.*--staging disk"):
            hold_private_dir(str(where))
        remove_private_dir(str(where))
        assert where.is_dir(), "held: not removed"
    finally:
        os.close(fd)
    remove_private_dir(str(where))
    assert not where.exists()


def test_a_killed_runs_memory_staging_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    live, killed = tmp_path / "cairn-live", tmp_path / "cairn-killed"
    unmarked, other = tmp_path / "cairn-unmarked", tmp_path / "not-cairn"
    for plain in (unmarked, other):
        plain.mkdir()
        (plain / "dump-1").write_bytes(b"y")
    (tmp_path / "cairn-link").symlink_to(other)
    ours = tmp_path / "cairn-ours"
    ours.mkdir()
    (ours / HELD_MARK).write_bytes(b"")
    holders = [start_holder(live), start_holder(killed)]
    try:
        assert remove_abandoned(str(tmp_path), keep=str(ours)) == []
        holders[1].kill()  # SIGKILL: no chance to clean up
        holders[1].wait()
        assert remove_abandoned(str(tmp_path), keep=str(ours)) == [(str(killed), 8192)]
        assert not killed.exists() and (live / "dump-1").exists()
        for kept in (unmarked / "dump-1", other / "dump-1", ours / HELD_MARK):
            assert kept.exists(), kept
        assert (tmp_path / "cairn-link").is_symlink()
        holders[0].terminate()  # any end of the process ends the hold
        holders[0].wait()
        assert sorted(remove_abandoned(str(tmp_path))) == [(str(live), 8192), (str(ours), 0)]
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
