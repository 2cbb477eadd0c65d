"""One call on a daemon thread of its own, started at once, whose caller collects the outcome
later: ``cairn run`` runs its host checks and feature probes (subprocesses) beside opening the
store, not before it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """``call()`` on a daemon thread named ``name``, started by the constructor. The thread
    touches only what ``call`` touches. :meth:`result` waits for it, then returns what it
    returned or raises what it raised, as often as it is asked."""

    def __init__(self, call: Callable[[], T], *, name: str) -> None:
        self._call = call
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._call()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self._error = e

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value] - set when _run returned
