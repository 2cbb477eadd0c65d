"""``python -m cairn``: the ``cairn`` command where its script is not installed."""

from __future__ import annotations

import sys

from cairn.cli.entry import main

sys.exit(main())
