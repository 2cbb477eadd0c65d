"""A fixture for tests that leave Checkpointers open: each installs its preemption handlers for
SIGTERM and SIGUSR1; pytest's own come back after the test. Import it into a test module."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def restore_signal_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
