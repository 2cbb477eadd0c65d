"""ADR 0008's claims about the privileges CRIU needs, checked with real CRIU on every CI run.

Each test runs one full cycle of ``scripts/criu_capabilities.py`` — write ns_last_pid, start a
counting workload, ``criu dump --leave-running``, kill it, ``criu restore --restore-sibling``,
see it count on with its PID — as uid 0 holding only the capabilities under test (capsh drops
the rest from every set, as a container runtime would), in a private mount namespace.

The minimal sets recorded in ``MEASURED_MINIMAL`` must pass, and each must fail without any one
of its capabilities, with the CRIU error the ADR names. Needs root, criu, capsh (Debian:
libcap2-bin) and unshare; the seccomp tests also need cc and libseccomp-dev.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.isolated, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "criu_capabilities.py"


def _load_script():  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location("criu_capabilities", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


caps = _load_script()
CONFIGS = {name: (opts, nnp) for name, opts, nnp in caps.CONFIGS}

needs_tools = pytest.mark.skipif(
    os.geteuid() != 0 or caps.find_criu() is None or shutil.which("capsh") is None
    or shutil.which("unshare") is None,
    reason="needs root, criu (scripts/build_criu.sh), capsh (apt-get install libcap2-bin) and unshare",
)
needs_seccomp = pytest.mark.skipif(
    (shutil.which("cc") is None and shutil.which("gcc") is None) or not Path("/usr/include/seccomp.h").exists(),
    reason="needs cc and the libseccomp headers (apt-get install gcc libseccomp-dev)",
)


def _cycle(config: str, capabilities, **kw):  # noqa: ANN001, ANN003, ANN202
    opts, nnp = CONFIGS[config]
    return caps.run_cycle(capabilities, criu_opts=opts, no_new_privs=nnp, **kw)


def _explain(c) -> str:  # noqa: ANN001
    return f"caps {caps.short(c.caps)} (saw {c.seen_caps}): failed at {c.stage}: {c.error}"


@needs_tools
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_minimal_set_is_enough(config: str) -> None:
    c = _cycle(config, caps.MEASURED_MINIMAL[config])
    assert c.ok, _explain(c)
    assert c.ns_last_pid == "ok"


@needs_tools
@pytest.mark.parametrize(("config", "cap"), [(config, cap) for config in CONFIGS
                                             for cap in caps.MEASURED_MINIMAL[config]])
def test_each_capability_of_the_minimal_set_is_needed(config: str, cap: str) -> None:
    c = _cycle(config, [x for x in caps.MEASURED_MINIMAL[config] if x != cap])
    assert not c.ok, f"{config}: the cycle passed without {cap}"
    stage, words = caps.WHY_NEEDED[config][cap]
    assert (c.stage, words in c.error) == (stage, True), _explain(c)


@needs_tools
def test_the_recommended_kubernetes_set_is_enough() -> None:
    """The runtime's default capabilities plus ADR 0008's add list, criu run as cairn runs it."""
    c = _cycle("plain", caps.RECOMMENDED)
    assert c.ok, _explain(c)


@needs_tools
def test_a_read_only_proc_sys_stops_only_the_pid_cursor() -> None:
    """What runc mounts for a container that is not privileged: CRIU (clone3 with set_tid)
    still restores, but ns_last_pid cannot be written whatever the capabilities."""
    c = _cycle("unprivileged+nnp", caps.MEASURED_MINIMAL["unprivileged+nnp"], ro_proc_sys=True)
    assert not c.ok and c.stage == "ns_last_pid", _explain(c)
    assert "Read-only file system" in c.ns_last_pid


@needs_tools
@needs_seccomp
@pytest.mark.parametrize("profile", ["default-like.json", "allow-all.json"])
def test_any_seccomp_filter_stops_the_dump(profile: str) -> None:
    """Even with every capability, and even with a filter that denies nothing, CRIU cannot
    suspend the workload's seccomp: the kernel refuses PTRACE_O_SUSPEND_SECCOMP to a tracer that
    is itself under a filter. Hence seccompProfile: Unconfined."""
    c = _cycle("plain", caps.host_capabilities(), profile=caps.SECCOMP_DIR / profile)
    assert c.seccomp_mode == "2", _explain(c)
    assert not c.ok and c.stage == "dump", _explain(c)
    assert "suspending seccomp failed" in c.error, _explain(c)
