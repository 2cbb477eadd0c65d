"""The ``cairn`` command's entry point.

For ``cairn run`` it begins the host work (:mod:`cairn.process.host_start`: ``/proc/sys``
made writable, then ``criu --version`` and ``criu check`` on a thread) before it imports the
CLI, so that those subprocesses run beside the ~0.15 s of imports a cold start spends instead
of after them: a restore's ``criu restore`` starts that much sooner (ADR 0039, amended). Every
other command goes straight to :func:`cairn.cli.main.main`. Imports here stay in the
standard library until the command is known.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# Options of ``cairn run`` that end it before any host work (argparse answers and exits).
_ENDS_AT_ONCE = frozenset({"-h", "--help"})


def _options(args: Sequence[str]) -> list[str]:
    """``cairn run``'s own arguments: those before ``--`` (the workload's command follows)."""
    return list(args[: args.index("--")]) if "--" in args else list(args)


def begins_host_work(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (without the program's name) is a ``cairn run`` worth beginning the
    host work for. Global options come before the command (``cairn -v run ...``)."""
    args = list(argv)
    while args and args[0].startswith("-") and args[0] not in _ENDS_AT_ONCE:
        args = args[1:]
    if not args or args[0] != "run":
        return False
    return not _ENDS_AT_ONCE.intersection(_options(args[1:]))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if begins_host_work(args):
        from cairn.process import host_start

        # A run that skips the checks is told so by its own options; one whose workload
        # happens to take a ``--no-preflight`` of its own (no ``--`` before it) merely has
        # its checks begun later, by the supervisor, which decides from the parsed options.
        host_start.begin(preflight="--no-preflight" not in _options(args))
    from cairn.cli.main import main as cli_main

    return cli_main(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
