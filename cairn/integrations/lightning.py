"""PyTorch Lightning: resume ``Trainer.fit`` from a cairn store.

::

    from cairn.integrations.lightning import CairnCheckpoint

    trainer = L.Trainer(max_steps=10_000, callbacks=[CairnCheckpoint(every_steps=200)])
    trainer.fit(model, datamodule=dm)       # CAIRN_STORE, CAIRN_KEY from the operator

When fit starts (``on_fit_start``: the strategy is set up, optimizers and schedulers exist),
the callback restores the newest snapshot that verifies: the LightningModule's state dict,
every optimizer and LR scheduler, the precision plugin (AMP scaler), the RNGs, the fit loop's
progress (``trainer.fit_loop.state_dict()``, the ``"loops"`` entry of Lightning's own
checkpoints, so ``global_step``, the epoch and the batch index continue from the snapshot),
the state of stateful data loaders, callbacks and the datamodule. It snapshots after every
``every_steps``-th optimizer step (``on_train_batch_end``, the point where Lightning's
``ModelCheckpoint(every_n_train_steps=...)`` saves) or ``every_seconds``, and when fit ends
it takes a last snapshot and closes: every snapshot is durable when ``fit`` returns.

Exact resume needs what Lightning's own mid-epoch resume needs: a train loader that can save
its position (torchdata's ``StatefulDataLoader``; a plain ``DataLoader`` restarts the epoch from
its first batch, with Lightning's warning). The global RNGs are set once more when training
starts, after Lightning has set up the loader, which draws from them. Before Lightning starts
the train loader's workers, the callback puts cairn's worker hook on it
(:mod:`cairn.state.loader_workers`), so augmentation drawn from the global RNGs inside workers
resumes exactly too.

Validation and schedulers stay on the uninterrupted timeline: when a snapshot falls on a step
that validates, it is taken at the end of that validation (``on_validation_end``, where
Lightning's ``ModelCheckpoint`` saves), so the resumed fit neither skips nor repeats it and
steps ``ReduceLROnPlateau`` with the value it computed; the trainer's ``callback_metrics``
(numbers only) are snapshotted and put back, so a scheduler monitoring a validation metric
finds it before the resumed fit has validated.

Not captured: state a LightningModule keeps only through ``on_save_checkpoint`` (keep it in
buffers, or in a callback's ``state_dict``) and loggers. A train loader whose position or
worker RNGs cannot be saved is named in one log line when the fit resumes. Lightning fetches
a batch ahead of a loader without ``__len__``: the callback snapshots that loader's position
and the RNGs from before that fetch, so the resumed fit fetches the batch again.
Sharded strategies (FSDP, DeepSpeed, ModelParallel) are refused. Single-device training is
tested; DDP takes one part per rank, as under torchrun, but has not been run.
"""

from __future__ import annotations

import collections
import copy
import logging
from typing import Any

from cairn.exceptions import ConfigError
from cairn.integrations._common import (
    CheckpointingCallback,
    close_quietly,
    make_checkpointer,
    missing,
)

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as _lightning_error:
    try:  # the standalone package, same API
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy  # type: ignore[no-redef]
    except ImportError:
        raise missing("PyTorch Lightning", "lightning", _lightning_error) from None

from cairn.state import capture, loader_workers
from cairn.state.codec import flatten

log = logging.getLogger(__name__)

STATE_VERSION = 1

__all__ = ["CairnCheckpoint"]


class CairnCheckpoint(CheckpointingCallback, pl.Callback):
    """Restore fit from a cairn store when it starts; snapshot while it runs.

    Give ``store=`` and ``key=``, or neither to read ``CAIRN_STORE`` and ``CAIRN_KEY``
    (:meth:`cairn.state.Checkpointer.from_env`), or a ready ``checkpointer=``. Other keyword
    options (``policy=``, ``persist=``, ``preemption=``, ...) go to the Checkpointer, which is
    created when fit starts. ``save_on_end``: snapshot the finished state when fit ends, so a
    retry after a later failure in the same task skips training. ``finish``: mark the key done
    (and drop its snapshots) when fit ends, for a task whose only work is this fit.
    """

    def _reset(self) -> None:
        self._unsaveable: set[str] = set()
        self._pending: int | None = None  # a due snapshot's step, taken when validation ends
        self._metrics: dict[str, Any] | None = None  # callback_metrics to put back
        self._ahead_rng: dict[str, Any] | None = None  # RNGs for the batch fetched ahead

    # -- restore -----------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_strategy(trainer)
        if self.checkpointer is not None:
            raise ConfigError("this CairnCheckpoint already ran a fit; use a new one per fit")
        ckpt = make_checkpointer(**self._factory)
        # The train loader's position lives in the trainer state, dealt to its ranks as they
        # were: on another number of ranks samples would repeat or be skipped (issue 35).
        ckpt.resize_refusal = ("CairnCheckpoint keeps the train loader's position in "
                               "Lightning's state, which is not dealt to another number of "
                               "ranks yet")
        self.checkpointer = ckpt
        self._hook_train_loader(trainer)
        trainer_state = _TrainerState(self, trainer)
        start = ckpt.restore(
            model=pl_module,
            optimizers={str(i): opt for i, opt in enumerate(trainer.optimizers)},
            # The scheduler objects, not their configs: interval and frequency come from
            # configure_optimizers again, as with Lightning's own checkpoints.
            scheduler={str(i): c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)},
            scaler={"precision": trainer.precision_plugin},
            items={"lightning": trainer_state},
        )
        if ckpt.restored_from is None:
            self._last_global_step = trainer.global_step
            return
        state = trainer_state.loaded
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"snapshot seq {ckpt.restored_from.seq} of key {ckpt.key} holds no "
                              "Lightning loop state this version understands; was it written by "
                              "CairnCheckpoint? (start fresh with: cairn rm STORE KEY)")
        self._ignore_ckpt_path(trainer)
        # Lightning's own order (_CheckpointConnector.restore): datamodule, callbacks, loops.
        datamodule = trainer.datamodule
        if datamodule is not None and state.get("datamodule"):
            datamodule.load_state_dict(state["datamodule"])
        saved_callbacks = state.get("callbacks") or {}
        for callback in trainer.callbacks:
            if callback is not self and callback.state_key in saved_callbacks:
                callback.load_state_dict(saved_callbacks[callback.state_key])
        trainer.fit_loop.load_state_dict(state["fit_loop"])
        if trainer.global_step != start:
            raise ConfigError(f"restored the fit loop at global step {trainer.global_step}, but the "
                              f"snapshot was taken after step {start - 1}: this Lightning version "
                              "restores loop progress differently")
        self.restored_step = start - 1
        self._last_global_step = trainer.global_step
        self._metrics = state.get("callback_metrics") or None
        self._ahead_rng = state.get("ahead_rng")
        # Setting up the train loader between here and the first batch draws from the global
        # RNG; the uninterrupted run drew those at its epoch start, long before the snapshot.
        self._rng = capture.rng_state()
        log.info("key %s: Lightning fit resumes at global step %d (epoch %d)", ckpt.key,
                 trainer.global_step, trainer.current_epoch)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._metrics is not None:
            import torch

            # A scheduler monitoring a validation metric steps before the resumed fit has
            # validated; it gets the value the uninterrupted fit would have.
            trainer.callback_metrics.update(
                {k: torch.tensor(v) for k, v in self._metrics.items()
                 if k not in trainer.callback_metrics})
            self._metrics = None
        if self._rng is not None:
            capture.set_rng_state(self._rng)
            self._rng = None

    def _hook_train_loader(self, trainer: pl.Trainer) -> None:
        """Run :meth:`_train_loader_ready` once Lightning has built the train loader and
        loaded its state, before it creates the loader's iterator (and starts its workers)."""
        fit_loop = trainer.fit_loop
        load = getattr(fit_loop, "_load_combined_loader_states", None)
        if load is None:
            log.warning("this Lightning version gives no hook before the train loader starts; "
                        "augmentation drawn in its workers is not snapshotted")
            return

        def load_then_hook() -> None:
            states = list(getattr(fit_loop, "_combined_loader_states_to_load", None) or [])
            load()
            self._train_loader_ready(trainer, states)

        fit_loop._load_combined_loader_states = load_then_hook

    def _train_loader_ready(self, trainer: pl.Trainer, states: list[Any]) -> None:
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        loaders = list(combined.flattened) if combined is not None else []
        wrapped = []
        for loader in loaders:
            loader_workers.install(loader)
            if not _has_len(loader) and hasattr(loader, "state_dict"):
                loader = _FetchedAhead(loader, lambda: _prefetched(trainer))
            wrapped.append(loader)
        if any(a is not b for a, b in zip(wrapped, loaders)):
            combined.flattened = wrapped
        if self.restored_step is None:
            return
        if self._ahead_rng is not None:
            # The loader resumes before the batch Lightning had fetched ahead; Lightning
            # fetches it again right after this, from the RNGs it was first fetched with.
            for loader in wrapped:
                if isinstance(loader, _FetchedAhead):
                    loader_workers.resume_iterator(loader.loader)
            capture.set_rng_state(self._ahead_rng)
            self._ahead_rng = None
        remaining = iter(states)  # one per stateful loader, in order
        reasons = []
        for loader in loaders:
            state = next(remaining, None) if hasattr(loader, "state_dict") else None
            reasons += loader_workers.diagnose(loader, state)
        loader_workers.log_if_not_exact(
            reasons, what=f"resuming the Lightning fit at global step {self.restored_step + 1}")

    # -- snapshot ----------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_global_step:
            return  # accumulating gradients: no optimizer step, nothing consistent to save
        self._last_global_step = step
        if self._validates_now(trainer):
            # Snapshot after this step's validation, not before it: see on_validation_end.
            self._pending = step - 1
            return
        if self.checkpointer.step(step - 1):
            self.saved_step = step - 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit_loop = trainer.fit_loop
        if self.restored_step is not None and fit_loop.restarting:
            # Lightning skips the epoch-interval ReduceLROnPlateau at the end of the epoch a
            # fit restarted in, as if the checkpoint had been saved at its end. Every cairn
            # snapshot is taken before the epoch ends, so that step is still due: let
            # Lightning take it, right after these hooks as in the uninterrupted fit.
            fit_loop._restarting = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step, self._pending = self._pending, None
        if step is None or trainer.sanity_checking or self.checkpointer is None:
            return
        # Lightning restarts a fit saved here past this validation (RESTARTED_ON_LAST) and
        # steps the plateau schedulers with the restored callback_metrics.
        if self.checkpointer.step(step):
            self.saved_step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self._pending is not None:
            # The validation expected did not run; its step's snapshot would now hold a
            # loader one batch ahead, so the next due step snapshots instead.
            log.info("step %d: validation did not run; no snapshot at this step", self._pending)
            self._pending = None

    def _validates_now(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning validates right after this batch (as ``on_advance_end`` decides)."""
        epoch_loop = trainer.fit_loop.epoch_loop
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        try:
            # Not val_loop.skip: it reads as True until the val loader is first set up.
            return (fetcher is not None and not epoch_loop._skip_next_val
                    and bool(epoch_loop._should_check_val_fx(fetcher)))
        except (AttributeError, TypeError):
            return False  # another Lightning version: snapshot here, before validation

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is None:
            return
        try:
            step = trainer.global_step - 1
            if self.finish:
                ckpt.finish()
            elif self.save_on_end and step >= 0 and step not in (self.saved_step,
                                                                 self.restored_step):
                ckpt.save(step, wait=True)
                self.saved_step = step
        except BaseException as e:
            close_quietly(ckpt, e)
            raise
        ckpt.close()  # raises if the last snapshot failed

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            close_quietly(ckpt, exception)

    # -- helpers -----------------------------------------------------------------------------

    def _state(self, trainer: pl.Trainer) -> dict[str, Any]:
        """What Lightning keeps besides modules, optimizers and schedulers, as a tree of
        JSON values and tensors: its ``"loops"``, callback and datamodule checkpoint entries."""
        callbacks = {}
        for callback in trainer.callbacks:
            if callback is self:
                continue
            state = callback.state_dict()
            if state and self._saveable(f"callback {callback.state_key}", state):
                callbacks[callback.state_key] = state
        datamodule = None
        if trainer.datamodule is not None:
            state = trainer.datamodule.state_dict()
            if state and self._saveable("datamodule", state):
                datamodule = state
        return {"version": STATE_VERSION, "lightning": pl.__version__,
                "fit_loop": trainer.fit_loop.state_dict(), "callbacks": callbacks,
                "datamodule": datamodule, "callback_metrics": _numbers(trainer.callback_metrics),
                "ahead_rng": _ahead_rng(trainer)}

    def _saveable(self, what: str, state: Any) -> bool:
        if what in self._unsaveable:
            return False
        try:
            flatten(state, where=what)
        except ConfigError as e:
            self._unsaveable.add(what)
            log.warning("%s is not snapshotted (it is restored fresh on resume): %s", what, e)
            return False
        return True

    def _ignore_ckpt_path(self, trainer: pl.Trainer) -> None:
        """``fit(ckpt_path=...)`` would restore the loops and optimizers from that file right
        after ``on_fit_start``, over the newer snapshot: drop the file's pending state."""
        if trainer.ckpt_path is None:
            return
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None or not hasattr(connector, "_loaded_checkpoint"):
            raise ConfigError(f"fit(ckpt_path={trainer.ckpt_path!r}) was given and a cairn snapshot "
                              "exists; this Lightning version gives no way to skip the file. Pass "
                              "ckpt_path only when the key has no snapshot")
        log.warning("fit(ckpt_path=%r) is ignored: resuming from cairn snapshot seq %d instead",
                    trainer.ckpt_path, self.checkpointer.restored_from.seq)
        connector._loaded_checkpoint = {}


class _TrainerState:
    """Lightning's own state (loops, callbacks, datamodule), a named item of the Checkpointer
    (``items=``), read only when a snapshot is taken: the loop state, with the data loaders'
    positions, is not built on every step. Loading only keeps the state; the callback applies
    it in Lightning's order."""

    def __init__(self, owner: CairnCheckpoint, trainer: pl.Trainer) -> None:
        self._owner = owner
        self._trainer = trainer
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return self._owner._state(self._trainer)

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


class _FetchedAhead:
    """Stands for a train loader without ``__len__``, ahead of which Lightning's
    ``_PrefetchDataFetcher`` fetches a batch: records the loader's state and the global RNGs
    before each fetch, and reports as its ``state_dict`` the state from before the oldest
    batch fetched but not yet trained (so a resume fetches that batch again, instead of
    skipping it). Everything else goes to the loader."""

    def __init__(self, loader: Any, prefetched: Any) -> None:
        self.loader = loader
        self._prefetched = prefetched
        self.before: collections.deque[tuple[Any, dict[str, Any]]] = collections.deque(maxlen=4)

    def __iter__(self) -> Any:
        return _Recording(self, iter(self.loader))

    def state_dict(self) -> Any:
        ahead = self._prefetched()
        if 0 < ahead <= len(self.before):
            return self.before[-ahead][0]
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)

    def rng_before(self) -> dict[str, Any] | None:
        ahead = self._prefetched()
        return self.before[-ahead][1] if 0 < ahead <= len(self.before) else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _Recording:
    def __init__(self, owner: _FetchedAhead, iterator: Any) -> None:
        self._owner = owner
        self._iterator = iterator

    def __iter__(self) -> _Recording:
        return self

    def __next__(self) -> Any:
        owner = self._owner
        owner.before.append((copy.deepcopy(owner.loader.state_dict()), capture.rng_state()))
        return next(self._iterator)


def _prefetched(trainer: pl.Trainer) -> int:
    """How many batches Lightning's data fetcher holds fetched but not yet trained."""
    return len(getattr(getattr(trainer.fit_loop, "_data_fetcher", None), "batches", None) or ())


def _ahead_rng(trainer: pl.Trainer) -> dict[str, Any] | None:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    for loader in (combined.flattened if combined is not None else []):
        if isinstance(loader, _FetchedAhead):
            return loader.rng_before()
    return None


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except (TypeError, NotImplementedError):
        return False
    return True


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The scalar entries of ``callback_metrics`` as floats (a metric is a 0-d tensor)."""
    out = {}
    for name, value in metrics.items():
        try:
            if getattr(value, "numel", lambda: 1)() == 1:
                out[str(name)] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
    return out


def _check_strategy(trainer: pl.Trainer) -> None:
    strategy = trainer.strategy
    # Sharded strategies restore after setup and hold parameters the module's state_dict
    # does not describe; cairn does not reshard.
    if (not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
            or strategy.restore_checkpoint_after_setup):
        raise ConfigError(f"CairnCheckpoint supports single-device and DDP training, not "
                          f"{type(strategy).__name__}")
