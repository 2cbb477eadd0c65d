"""The doctor's parsers and checks, fed fixture text from /proc, nvidia-smi and criu."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

import pytest

from cairn.exceptions import ConfigError
from cairn.process import criu
from cairn.process.doctor import (
    ASSUMED_D2H_BYTES_PER_S,
    CgroupMemory,
    CgroupVersion,
    Check,
    DoctorReport,
    Gpu,
    SeccompMode,
    Status,
    check_capabilities,
    check_criu_binary,
    check_criu_kernel,
    check_kernel,
    check_memory,
    check_ns_last_pid,
    check_nvidia,
    check_seccomp,
    decode_capabilities,
    effective_capabilities,
    estimate_frozen_seconds,
    memory_cgroup_files,
    parse_cgroup_memory,
    parse_cgroup_version,
    parse_kernel_release,
    parse_meminfo,
    parse_nvidia_driver_version,
    parse_seccomp,
    mps_in_use,
    run_doctor,
)
from cairn.process.gpus import GpuDevice, Inventory, Source

GiB = 1 << 30

# /proc/self/status of a Docker container with the default capabilities and seccomp profile.
DOCKER_STATUS = """\
Name:\tpython
Umask:\t0022
State:\tR (running)
CapInh:\t0000000000000000
CapPrm:\t00000000a80425fb
CapEff:\t00000000a80425fb
CapBnd:\t00000000a80425fb
CapAmb:\t0000000000000000
NoNewPrivs:\t0
Seccomp:\t2
Seccomp_filters:\t1
"""

# A privileged root shell (this repo's dev machines: everything but CAP_SYS_RESOURCE).
PRIVILEGED_STATUS = DOCKER_STATUS.replace("00000000a80425fb", "000001fffeffffff").replace(
    "Seccomp:\t2\nSeccomp_filters:\t1", "Seccomp:\t0\nSeccomp_filters:\t0")

DOCKER_DEFAULT_CAPS = {
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT",
    "CAP_MKNOD", "CAP_AUDIT_WRITE", "CAP_SETFCAP",
}

MEMINFO = """\
MemTotal:       24683656 kB
MemFree:        22000000 kB
MemAvailable:   24261660 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

HYBRID_MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"
V1_MOUNTS = "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"

NVIDIA_VERSION = """\
NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024
GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)
"""


# -- capabilities ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "mask, expected",
    [
        ("0000000000000000", set()),
        ("00000000a80425fb", DOCKER_DEFAULT_CAPS),
        ("0000000000200000", {"CAP_SYS_ADMIN"}),
        ("0000010000080000", {"CAP_CHECKPOINT_RESTORE", "CAP_SYS_PTRACE"}),
        (1 << 12 | 1 << 24, {"CAP_NET_ADMIN", "CAP_SYS_RESOURCE"}),
        ("8000000000000001", {"CAP_CHOWN", "CAP_63"}),
    ],
)
def test_decode_known_capability_masks(mask: str | int, expected: set[str]) -> None:
    assert decode_capabilities(mask) == expected


def test_full_mask_without_sys_resource() -> None:
    caps = decode_capabilities("000001fffeffffff")
    assert len(caps) == 40
    assert "CAP_CHECKPOINT_RESTORE" in caps and "CAP_SYS_RESOURCE" not in caps


def test_effective_capabilities_reads_capeff_not_capprm() -> None:
    text = DOCKER_STATUS.replace("CapPrm:\t00000000a80425fb", "CapPrm:\t000001ffffffffff")
    assert effective_capabilities(text) == DOCKER_DEFAULT_CAPS
    assert effective_capabilities("Name:\tx\n") is None


def test_capability_check_in_a_default_container() -> None:
    # Docker's defaults lack three of the measured set (ADR 0008); SETPCAP and SYS_CHROOT are in.
    report = check_capabilities(DOCKER_STATUS, preflight=False, ptrace_scope="1\n")
    assert report.status is Status.WARN
    missing = report.detail.split("missing required: ")[1]
    assert missing.split(", ") == ["CAP_SYS_ADMIN", "CAP_SYS_TIME", "CAP_NET_ADMIN",
                                   "CAP_SYS_PTRACE"]
    failed = check_capabilities(DOCKER_STATUS, preflight=True)
    assert failed.status is Status.FAIL
    assert "SYS_ADMIN, SYS_TIME, NET_ADMIN, SYS_PTRACE" in failed.fix and "0008" in failed.fix


def test_yama_scope_zero_stands_in_for_sys_ptrace() -> None:
    # SYS_ADMIN, SYS_TIME, NET_ADMIN, SYS_CHROOT, SETPCAP: the measured set, no SYS_PTRACE.
    bits = [21, 25, 12, 18, 8]
    mask = f"{sum(1 << b for b in bits):016x}"
    text = DOCKER_STATUS.replace("00000000a80425fb", mask)
    strict = check_capabilities(text, preflight=True, ptrace_scope="1\n")
    assert strict.status is Status.FAIL and "CAP_SYS_PTRACE" in strict.detail
    relaxed = check_capabilities(text, preflight=True, ptrace_scope="0\n")
    assert relaxed.status is Status.WARN  # required ones there; the useful ones still missing
    assert "missing required" not in relaxed.detail


def test_capability_check_names_what_is_present() -> None:
    report = check_capabilities(PRIVILEGED_STATUS, preflight=True)
    assert report.status is Status.WARN  # only CAP_SYS_RESOURCE missing: not fatal
    assert "CAP_SYS_ADMIN" in report.detail and "CAP_CHECKPOINT_RESTORE" in report.detail
    assert report.fix.endswith("[SYS_RESOURCE]")


# -- seccomp -----------------------------------------------------------------------------------

def test_parse_seccomp() -> None:
    assert parse_seccomp(DOCKER_STATUS) is SeccompMode.FILTER
    assert parse_seccomp(PRIVILEGED_STATUS) is SeccompMode.DISABLED
    assert parse_seccomp("Seccomp:\t1\n") is SeccompMode.STRICT
    assert parse_seccomp("Name:\tx\n") is None


def test_seccomp_filter_fails_preflight_naming_unconfined() -> None:
    assert check_seccomp(PRIVILEGED_STATUS, preflight=True).status is Status.OK
    assert check_seccomp(DOCKER_STATUS, preflight=False).status is Status.WARN
    failed = check_seccomp(DOCKER_STATUS, preflight=True)
    assert failed.status is Status.FAIL
    assert "filter" in failed.detail and "1 filters" in failed.detail
    assert "seccompProfile" in failed.fix and "Unconfined" in failed.fix


# -- memory ------------------------------------------------------------------------------------

def test_parse_meminfo_scales_kb() -> None:
    info = parse_meminfo(MEMINFO)
    assert info["MemAvailable"] == 24261660 * 1024
    assert info["HugePages_Total"] == 0
    assert info["Hugepagesize"] == 2048 * 1024


def test_memory_short_of_gpu_use_fails_preflight_with_estimate() -> None:
    gpus = (Gpu("NVIDIA H200", 100 * GiB, 141 * GiB), Gpu("NVIDIA H200", 20 * GiB, 141 * GiB))
    meminfo = "MemAvailable:   " + str(64 * GiB // 1024) + " kB\n"
    failed = check_memory(meminfo, gpus, preflight=True)
    assert failed.status is Status.FAIL
    assert "short by 56.0 GiB" in failed.detail
    assert "request at least 56.0 GiB more memory" in failed.fix
    seconds = 120 * GiB / ASSUMED_D2H_BYTES_PER_S
    assert f"est. {seconds:.1f}s frozen" in failed.detail and "assumed 10 GB/s" in failed.detail
    assert check_memory(meminfo, gpus, preflight=False).status is Status.WARN
    assert check_memory(MEMINFO, (), preflight=True).status is Status.OK
    assert check_memory("MemTotal: 1 kB\n", (), preflight=True).status is Status.WARN


def test_cgroup_limit_bounds_available_memory() -> None:
    gpus = (Gpu("g", 30 * GiB, 80 * GiB),)
    meminfo = f"MemAvailable: {500 * GiB // 1024} kB\n"
    pod = CgroupMemory(limit_bytes=40 * GiB, working_set_bytes=16 * GiB)
    failed = check_memory(meminfo, gpus, preflight=True, cgroup=pod)
    assert failed.status is Status.FAIL and "cgroup limit headroom" in failed.detail
    assert check_memory(meminfo, gpus, preflight=True,
                        cgroup=CgroupMemory(None, 16 * GiB)).status is Status.OK


def test_estimate_frozen_seconds() -> None:
    assert estimate_frozen_seconds(0) == 0
    assert estimate_frozen_seconds(int(ASSUMED_D2H_BYTES_PER_S * 8)) == pytest.approx(8.0)


def test_parse_cgroup_memory() -> None:
    v2 = parse_cgroup_memory("max\n", "1000\n", "anon 600\nfile 400\ninactive_file 300\n")
    assert v2 == CgroupMemory(None, 700)
    v1 = parse_cgroup_memory("9223372036854771712\n", "5000\n", "cache 10\ntotal_inactive_file 1000\n")
    assert v1.limit_bytes is None and v1.working_set_bytes == 4000
    limited = parse_cgroup_memory(f"{8 * GiB}\n", f"{3 * GiB}\n", f"inactive_file {GiB}\n")
    assert limited.headroom_bytes == 6 * GiB


def test_memory_cgroup_files() -> None:
    v1 = "4:memory:/process_api/abc\n0::/\n"
    assert memory_cgroup_files(v1, CgroupVersion.HYBRID) == (
        "/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/process_api/abc/memory.stat")
    assert memory_cgroup_files("0::/\n", CgroupVersion.V2) == (
        "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat")
    assert memory_cgroup_files("0::/\n", CgroupVersion.V1) is None


@pytest.mark.parametrize(
    "mounts, expected",
    [(HYBRID_MOUNTS, CgroupVersion.HYBRID), (V2_MOUNTS, CgroupVersion.V2),
     (V1_MOUNTS, CgroupVersion.V1), ("proc /proc proc rw 0 0\n", CgroupVersion.NONE)],
    ids=["hybrid", "v2", "v1", "none"],
)
def test_parse_cgroup_version(mounts: str, expected: CgroupVersion) -> None:
    assert parse_cgroup_version(mounts) is expected


# -- NVIDIA ------------------------------------------------------------------------------------

def test_parse_nvidia_driver_version() -> None:
    assert parse_nvidia_driver_version(NVIDIA_VERSION) == "550.54.15"
    assert parse_nvidia_driver_version("garbage") is None


def _inventory(*devices: GpuDevice, driver: str = "580.65.06") -> Inventory:
    return Inventory(Source.NVML, devices, driver, 13000)


H200 = GpuDevice(0, "GPU-aa", "NVIDIA H200", 143771 << 20, 2 * GiB, "9.0")


def test_nvidia_check_reports_what_the_driver_allows() -> None:
    none, gpus = check_nvidia(Inventory(Source.NONE), None, preflight=True)
    assert (none.status, none.detail, gpus) == (Status.OK, "no NVIDIA GPU", ())
    ok, gpus = check_nvidia(_inventory(H200), NVIDIA_VERSION, preflight=True)
    assert ok.status is Status.OK
    assert ok.detail.startswith("driver 580.65.06; 1 GPU(s) via NVML: NVIDIA H200 2.0 GiB")
    assert "restore onto another GPU: yes" in ok.detail
    assert gpus == (Gpu("NVIDIA H200", 2 * GiB, 143771 << 20),)
    no_remap, _ = check_nvidia(_inventory(H200, driver="570.86.10"), None, preflight=True)
    assert no_remap.status is Status.WARN and "needs driver >= 580" in no_remap.detail
    too_old, _ = check_nvidia(_inventory(H200, driver="550.54.15"), None, preflight=True)
    assert too_old.status is Status.FAIL and "need driver >= 570" in too_old.detail
    unseen, _ = check_nvidia(Inventory(Source.NONE, note="NVML failed: x"), NVIDIA_VERSION,
                             preflight=False)
    assert unseen.status is Status.WARN and "pynvml" in unseen.fix


def test_mig_and_mps_are_refused() -> None:
    mig = GpuDevice(1, "GPU-bb", "NVIDIA H200", 143771 << 20, 0, "9.0", mig=True)
    refused, _ = check_nvidia(_inventory(H200, mig), None, preflight=True)
    assert refused.status is Status.FAIL and "MIG is enabled on GPU 1" in refused.detail
    assert "state mode" in refused.fix
    warned, _ = check_nvidia(_inventory(H200), None, preflight=False, mps=True)
    assert warned.status is Status.WARN and "MPS is in use" in warned.detail
    listed = dataclasses.replace(_inventory(H200), mps_clients={H200.uuid: frozenset({7, 9})})
    by_nvml, _ = check_nvidia(listed, None, preflight=True)
    assert by_nvml.status is Status.FAIL
    assert "MPS is in use on GPU 0 (2 client(s), NVML)" in by_nvml.detail


def test_mps_is_seen_by_its_control_pipe(tmp_path) -> None:
    assert not mps_in_use({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    (tmp_path / "control").touch()
    assert mps_in_use({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})


# -- versions and CRIU -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [("Version: 4.1.1\nGitID: v4.1.1\n", (4, 1, 1)), ("Version: 3.17\n", (3, 17)),
     ("criu: unknown option\n", None), ("", None)],
)
def test_parse_criu_version(text: str, expected: tuple[int, ...] | None) -> None:
    assert criu.parse_version(text) == expected


def test_parse_kernel_release() -> None:
    assert parse_kernel_release("6.18.44-fc-v782\n") == (6, 18, 44)
    assert parse_kernel_release("5.4.0-150-generic") == (5, 4, 0)
    assert parse_kernel_release("unknown") is None
    assert check_kernel("5.4.0-150-generic", preflight=True).status is Status.FAIL
    assert check_kernel("6.1.0-28-amd64", preflight=True).status is Status.OK


def test_old_or_missing_criu_fails_preflight_naming_the_build_script() -> None:
    old = check_criu_binary("/usr/sbin/criu", (3, 17), preflight=True)
    assert old.status is Status.FAIL and "3.17" in old.detail and "scripts/build_criu.sh" in old.fix
    missing = check_criu_binary(None, None, preflight=True)
    assert missing.status is Status.FAIL and "CAIRN_CRIU" in missing.fix
    assert check_criu_binary(None, None, preflight=False).status is Status.WARN
    assert check_criu_binary("/x/criu", (4, 1, 1), preflight=True).status is Status.OK


def test_failing_criu_check_shows_its_output() -> None:
    result = criu.CriuCheck(False, "Error (criu/cr-check.c:1): ptrace: Operation not permitted\nFailed.")
    failed = check_criu_kernel("/x/criu", result, preflight=True)
    assert failed.status is Status.FAIL and "ptrace: Operation not permitted" in failed.detail
    assert check_criu_kernel("/x/criu", criu.CriuCheck(True, "Looks good."), preflight=True).status is Status.OK


def test_find_criu_order(tmp_path) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 4.1.1'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert criu.find_criu({"CAIRN_CRIU": str(fake)}, which=lambda _: "/usr/sbin/criu") == str(fake)
    assert criu.find_criu({}, which=lambda _: "/usr/sbin/criu") == "/usr/sbin/criu"
    default_there = os.access(criu.DEFAULT_PATH, os.X_OK)
    assert criu.find_criu({}, which=lambda _: None) == (criu.DEFAULT_PATH if default_there else None)
    with pytest.raises(ConfigError, match="CAIRN_CRIU=/nonexistent/criu is not an executable"):
        criu.find_criu({"CAIRN_CRIU": "/nonexistent/criu"})
    assert criu.criu_version(str(fake)) == (4, 1, 1)


def test_criu_check_of_a_binary_that_cannot_run() -> None:
    result = criu.criu_check("/nonexistent/criu")
    assert not result.ok and "cannot run" in result.output


# -- the report --------------------------------------------------------------------------------

def test_ns_last_pid_check() -> None:
    root = decode_capabilities("000001fffeffffff")
    assert check_ns_last_pid(None, root, preflight=True).status is Status.OK
    failed = check_ns_last_pid("EROFS (Read-only file system)", root, preflight=True)
    assert failed.status is Status.FAIL and "EROFS" in failed.detail and "/proc/sys" in failed.fix
    # The file is 0666: opening it is not enough without the capability the kernel checks.
    no_cap = check_ns_last_pid(None, frozenset(DOCKER_DEFAULT_CAPS), preflight=True)
    assert no_cap.status is Status.FAIL and "CAP_CHECKPOINT_RESTORE" in no_cap.detail
    assert check_ns_last_pid(None, frozenset(DOCKER_DEFAULT_CAPS), preflight=False).status is Status.WARN


def test_report_ok_json_and_text() -> None:
    report = DoctorReport((Check("a", Status.OK, "fine"), Check("b", Status.WARN, "meh", "do x")),
                          preflight=False)
    assert report.ok
    doc = json.loads(report.to_json())
    assert doc["ok"] is True and doc["checks"][1] == {"name": "b", "status": "warn", "detail": "meh", "fix": "do x"}
    text = report.format_text()
    assert "[WARN] b  meh" in text and "fix: do x" in text
    bad = DoctorReport(report.checks + (Check("c", Status.FAIL, "no", "fix c"),), preflight=True)
    assert not bad.ok and "NOT ok" in bad.format_text()


def test_preflight_in_a_default_container_fails_naming_fixes() -> None:
    """run_doctor on fixture /proc text: a default Docker container (nvidia-smi is this host's)."""
    files = {
        "/proc/self/status": DOCKER_STATUS,
        "/proc/sys/kernel/osrelease": "6.1.0-28-amd64\n",
        "/proc/meminfo": MEMINFO,
        "/proc/self/mounts": V2_MOUNTS,
    }
    report = run_doctor(preflight=True, read=files.get, env={"CAIRN_CRIU": "/nonexistent/criu"})
    assert not report.ok
    failed = {c.name: c for c in report.checks if c.status is Status.FAIL}
    assert {"criu", "criu check", "capabilities", "seccomp", "ns_last_pid"} <= failed.keys()
    assert "Unconfined" in failed["seccomp"].fix
    assert "CAIRN_CRIU=/nonexistent/criu" in failed["criu"].detail
    assert report.check("kernel").status is Status.OK
    assert report.check("cgroup").detail == "v2"
    assert run_doctor(preflight=False, read=files.get, env={"CAIRN_CRIU": "/nonexistent/criu"}).ok  # WARNs only


def test_a_preflight_runs_the_checks_beside_its_caller_and_hands_over_their_outcome(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from cairn.process import doctor

    release = threading.Event()
    report = DoctorReport((Check("criu", Status.FAIL, "missing"),), preflight=True)

    def checks(*, preflight: bool) -> DoctorReport:
        assert preflight
        if not release.wait(10):  # set only once Preflight() has returned
            raise AssertionError("Preflight() waited for the checks it was to run beside it")
        return report

    monkeypatch.setattr(doctor, "run_doctor", checks)
    pending = doctor.Preflight()  # returns while the checks still wait: they run beside us
    release.set()
    assert pending.report() is report and not pending.report().ok

    def broken(*, preflight: bool) -> DoctorReport:
        raise OSError("cannot read /proc/self/status")

    monkeypatch.setattr(doctor, "run_doctor", broken)
    with pytest.raises(OSError, match="/proc/self/status"):
        doctor.Preflight().report()
