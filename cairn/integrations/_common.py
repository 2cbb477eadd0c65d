"""What the framework integrations share: building the Checkpointer, closing it on the way out."""

from __future__ import annotations

import logging
from typing import Any

from cairn.exceptions import ConfigError
from cairn.runtime import env

log = logging.getLogger(__name__)


def missing(library: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError an integration raises when its framework is not installed."""
    return ImportError(f"{library} is not installed (import failed: {error}); "
                       f"install it with: pip install 'cairn-resume[{extra}]'")


def make_checkpointer(*, checkpointer: Any, store: Any, key: Any, options: dict[str, Any]) -> Any:
    """``checkpointer`` as given, else ``Checkpointer(store=, key=, **options)``, else
    ``Checkpointer.from_env(**options)`` (``CAIRN_STORE``, ``CAIRN_KEY``)."""
    from cairn.state.checkpointer import Checkpointer

    if checkpointer is not None:
        if store is not None or key is not None or options:
            raise ConfigError("pass checkpointer= or store=/key= and options, not both")
        return checkpointer
    if (store is None) != (key is None):
        raise ConfigError(f"pass both store= and key=, or neither (then {env.STORE} and "
                          f"{env.KEY} are read)")
    if store is None:
        return Checkpointer.from_env(**options)
    return Checkpointer(store=store, key=key, **options)


def checkpointer_options(*, every_steps: int | None, every_seconds: float | None,
                         options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments for Checkpointer: only what the caller set, so that from_env's
    ``CAIRN_EVERY_STEPS``/``CAIRN_EVERY_SECONDS`` still apply to the rest."""
    merged = dict(options)
    if every_steps is not None:
        merged["every_steps"] = every_steps
    if every_seconds is not None:
        merged["every_seconds"] = every_seconds
    return merged


def checkpointer_factory(*, store: Any, key: Any, checkpointer: Any, every_steps: int | None,
                         every_seconds: float | None, options: dict[str, Any]) -> dict[str, Any]:
    """What an integration keeps to build its Checkpointer when training starts (the keyword
    arguments of :func:`make_checkpointer`); ConfigError when ``checkpointer=`` comes with a
    store, key or options."""
    merged = checkpointer_options(every_steps=every_steps, every_seconds=every_seconds,
                                  options=options)
    if checkpointer is not None and (store is not None or key is not None or merged):
        raise ConfigError("pass checkpointer= or store=/key= and options, not both")
    return dict(store=store, key=key, checkpointer=checkpointer, options=merged)


class CheckpointingCallback:
    """What a trainer callback of cairn's holds, whatever the framework: how to build its
    Checkpointer when training starts (see :func:`make_checkpointer`), whether to snapshot when
    training ends and to mark the key done, and the steps restored and saved. A subclass sets
    its framework's own state in :meth:`_reset`."""

    def __init__(self, *, store: Any = None, key: Any = None, checkpointer: Any = None,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 save_on_end: bool = True, finish: bool = False, **options: Any) -> None:
        self._factory = checkpointer_factory(store=store, key=key, checkpointer=checkpointer,
                                             every_steps=every_steps,
                                             every_seconds=every_seconds, options=options)
        self.save_on_end = save_on_end
        self.finish = finish
        self.checkpointer: Any = None
        self.restored_step: int | None = None  # the step the snapshot holds (None: fresh)
        self.saved_step: int | None = None  # the step of the last snapshot taken (staged)
        self._rng: dict[str, Any] | None = None
        self._last_global_step = 0
        self._reset()

    def _reset(self) -> None:
        """The framework's own state, before training starts."""


def close_quietly(checkpointer: Any, reason: BaseException) -> None:
    """Close after a failure: wait for what was staged, but never mask ``reason``."""
    try:
        checkpointer.close()
    except Exception as e:  # noqa: BLE001 - the training error is the one to propagate
        log.error("closing the cairn Checkpointer after %s failed: %s", type(reason).__name__, e)
