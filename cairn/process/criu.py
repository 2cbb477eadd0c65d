"""Locate the CRIU binary, read its version and run ``criu check``.

Search order for the binary: ``$CAIRN_CRIU`` (must then exist), ``criu`` on ``PATH``, then
``/usr/local/sbin/criu`` (where ``scripts/build_criu.sh`` installs it; often not on a
non-root ``PATH``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cairn.exceptions import ConfigError

ENV_VAR = "CAIRN_CRIU"
DEFAULT_PATH = "/usr/local/sbin/criu"
MIN_VERSION: tuple[int, ...] = (4,)  # 4.0 brought the CUDA plugin that GPU processes need
CHECK_TIMEOUT_S = 60.0

_VERSION_RE = re.compile(r"^Version:\s*(\d+(?:\.\d+)*)", re.MULTILINE)


@dataclass(frozen=True)
class CriuCheck:
    """The outcome of ``criu check``: ``ok`` only when it exits 0 and says "Looks good"."""

    ok: bool
    output: str


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_criu(
    env: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> str | None:
    """The CRIU binary to use, or ``None`` when there is none.

    Raises :class:`ConfigError` when ``$CAIRN_CRIU`` is set but is not an executable file:
    silently using another binary would hide the typo.
    """
    env = os.environ if env is None else env
    given = env.get(ENV_VAR, "").strip()
    if given:
        if not _is_executable(given):
            raise ConfigError(f"{ENV_VAR}={given} is not an executable file; "
                              f"point it at a criu binary or unset it")
        return given
    on_path = which("criu")
    if on_path:
        return on_path
    return DEFAULT_PATH if _is_executable(DEFAULT_PATH) else None


def parse_version(text: str) -> tuple[int, ...] | None:
    """``criu --version`` output ("Version: 4.1.1" …) to ``(4, 1, 1)``; ``None`` if absent."""
    m = _VERSION_RE.search(text)
    return tuple(int(part) for part in m.group(1).split(".")) if m else None


def format_version(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def criu_version(binary: str) -> tuple[int, ...] | None:
    """The version ``binary --version`` reports, or ``None`` if it cannot run or says none."""
    try:
        done = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=CHECK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(done.stdout + done.stderr)


def criu_check(binary: str, *, unprivileged: bool | None = None) -> CriuCheck:
    """Run ``criu check`` (kernel and permission features CRIU needs) and keep its output.

    ``unprivileged`` defaults to "not root": CRIU refuses to run as non-root without
    ``--unprivileged``, and that refusal is not what the caller wants to learn about.
    """
    if unprivileged is None:
        unprivileged = os.geteuid() != 0
    argv = [binary, "check"] + (["--unprivileged"] if unprivileged else [])
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=CHECK_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        return CriuCheck(False, f"{' '.join(argv)} did not finish within {CHECK_TIMEOUT_S:.0f}s")
    except OSError as e:
        return CriuCheck(False, f"cannot run {binary}: {e}")
    output = done.stdout.strip()
    return CriuCheck(done.returncode == 0 and "Looks good" in output, output)
