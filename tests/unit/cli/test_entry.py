"""The ``cairn`` entry point begins ``cairn run``'s host work before the CLI's imports
(ADR 0039, amended), and only for a run."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cairn.cli.entry import begins_host_work

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("argv", "begins"), [
    (["run", "--store", "s", "--key", "k", "--", "python", "train.py"], True),
    (["-v", "run", "--store", "s", "--", "python", "train.py", "--help"], True),
    (["run", "--help"], False),
    (["run", "-h", "--", "x"], False),
    (["run", "--store", "s", "python", "train.py", "--help"], False),  # whose --help: unknown
    (["ls", "/tmp/store"], False),
    (["doctor", "--preflight"], False),
    (["--help"], False),
    ([], False),
])
def test_only_a_run_begins_the_host_work(argv: list[str], begins: bool) -> None:
    assert begins_host_work(argv) is begins


def _fake_criu(tmp_path: Path) -> Path:
    """A fake CRIU binary (a shell script, not CRIU): it notes each call in ``calls``, then
    answers as CRIU 4.1.1 does."""
    calls = tmp_path / "calls"
    fake = tmp_path / "criu"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$*" >> {calls}
        case "$1" in
          --version) echo 'Version: 4.1.1' ;;
          check) echo 'Looks good.' ;;
        esac
        """))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


# The CLI's import is held until the fake CRIU was called: with the checks begun after the
# imports (as before ADR 0039's amendment) it would wait forever, and the script says so.
HELD_IMPORT = textwrap.dedent("""\
    import os, sys, time

    class Hold:
        def find_spec(self, name, path=None, target=None):
            if name == "cairn.cli.main":
                deadline = time.monotonic() + float(os.environ["HOLD_S"])
                while not os.path.exists(os.environ["CALLS"]):
                    if time.monotonic() > deadline:
                        sys.exit("criu was not called while the CLI was being imported")
                    time.sleep(0.01)
            return None

    sys.meta_path.insert(0, Hold())
    from cairn.cli.entry import main
    sys.exit(main(sys.argv[1:]))
    """)


def _run(tmp_path: Path, *argv: str, hold_s: float) -> subprocess.CompletedProcess[str]:
    fake = _fake_criu(tmp_path)
    env = {**os.environ, "CAIRN_CRIU": str(fake), "CALLS": str(tmp_path / "calls"),
           "PYTHONPATH": str(REPO), "HOLD_S": str(hold_s)}
    return subprocess.run([sys.executable, "-c", HELD_IMPORT, *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_run_calls_criu_while_the_cli_is_still_being_imported(tmp_path: Path) -> None:
    # No --store: the CLI refuses the run once imported (exit 2), after the checks began.
    done = _run(tmp_path, "run", "--key", "k", "--", "true", hold_s=60)
    assert done.returncode == 2, done.stderr
    assert "give --store and --key" in done.stderr
    assert (tmp_path / "calls").read_text().splitlines()[0] == "--version"


def test_other_commands_do_not_call_criu_before_the_cli(tmp_path: Path) -> None:
    # Held 2 s: ample for a thread begun before the import to have called criu.
    done = _run(tmp_path, "run", "--help", hold_s=2)
    assert done.returncode == 1 and "criu was not called" in done.stderr
    assert not (tmp_path / "calls").exists()
