"""How every ``cairn`` command prints: JSON with ``--json``, else text; a progress bar unless
``--quiet``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cairn.cli.progress import ProgressBar


def emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    print(json.dumps(doc, indent=2) if args.json else text)


def progress(args: argparse.Namespace, label: str, total: int) -> ProgressBar:
    return ProgressBar(label, total, enabled=not args.quiet)
