"""The ``cairn`` command line. See :mod:`cairn.cli.main` for commands and exit codes."""
