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
starts, after Lightning has set up the loader, which may draw from them.

Not captured: state a LightningModule keeps only through ``on_save_checkpoint`` (keep it in
buffers, or in a callback's ``state_dict``), loggers, and a validation run that was due at
the snapshot's step (Lightning's restart logic skips it, as with its own checkpoints).
Sharded strategies (FSDP, DeepSpeed, ModelParallel) are refused. Single-device training is
tested; DDP takes one part per rank, as under torchrun, but has not been run.
"""

from __future__ import annotations

import logging
from typing import Any

from cairn.exceptions import ConfigError
from cairn.integrations._common import (
    checkpointer_options,
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

from cairn.state import capture
from cairn.state.codec import flatten

log = logging.getLogger(__name__)

STATE_VERSION = 1

__all__ = ["CairnCheckpoint"]


class CairnCheckpoint(pl.Callback):
    """Restore fit from a cairn store when it starts; snapshot while it runs.

    Give ``store=`` and ``key=``, or neither to read ``CAIRN_STORE`` and ``CAIRN_KEY``
    (:meth:`cairn.state.Checkpointer.from_env`), or a ready ``checkpointer=``. Other keyword
    options (``policy=``, ``persist=``, ``preemption=``, ...) go to the Checkpointer, which is
    created when fit starts. ``save_on_end``: snapshot the finished state when fit ends, so a
    retry after a later failure in the same task skips training. ``finish``: mark the key done
    (and drop its snapshots) when fit ends, for a task whose only work is this fit.
    """

    def __init__(self, *, store: Any = None, key: Any = None, checkpointer: Any = None,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 save_on_end: bool = True, finish: bool = False, **options: Any) -> None:
        merged = checkpointer_options(every_steps=every_steps, every_seconds=every_seconds,
                                      options=options)
        if checkpointer is not None and (store is not None or key is not None or merged):
            raise ConfigError("pass checkpointer= or store=/key= and options, not both")
        self._factory = dict(store=store, key=key, checkpointer=checkpointer, options=merged)
        self.save_on_end = save_on_end
        self.finish = finish
        self.checkpointer: Any = None
        self.restored_step: int | None = None  # the step the snapshot holds (None: fresh)
        self.saved_step: int | None = None  # the step of the last snapshot taken (staged)
        self._rng: dict[str, Any] | None = None
        self._last_global_step = 0
        self._unsaveable: set[str] = set()

    # -- restore -----------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_strategy(trainer)
        if self.checkpointer is not None:
            raise ConfigError("this CairnCheckpoint already ran a fit; use a new one per fit")
        ckpt = make_checkpointer(**self._factory)
        self.checkpointer = ckpt
        trainer_state = _TrainerState(self, trainer)
        start = ckpt.restore(
            model=pl_module,
            optimizers={str(i): opt for i, opt in enumerate(trainer.optimizers)},
            # The scheduler objects, not their configs: interval and frequency come from
            # configure_optimizers again, as with Lightning's own checkpoints.
            scheduler={str(i): c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)},
            scaler={"precision": trainer.precision_plugin},
            loader=trainer_state,
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
        # Setting up the train loader between here and the first batch draws from the global
        # RNG; the uninterrupted run drew those at its epoch start, long before the snapshot.
        self._rng = capture.rng_state()
        log.info("key %s: Lightning fit resumes at global step %d (epoch %d)", ckpt.key,
                 trainer.global_step, trainer.current_epoch)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None:
            capture.set_rng_state(self._rng)
            self._rng = None

    # -- snapshot ----------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_global_step:
            return  # accumulating gradients: no optimizer step, nothing consistent to save
        self._last_global_step = step
        if self.checkpointer.step(step - 1):
            self.saved_step = step - 1

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
                "datamodule": datamodule}

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
    """Lightning's own state (loops, callbacks, datamodule) in the Checkpointer's ``loader=``
    slot, which takes any object with ``state_dict``/``load_state_dict`` and reads it only
    when a snapshot is taken: the loop state, with the data loaders' positions, is not built
    on every step. Loading only keeps the state; the callback applies it in Lightning's order."""

    def __init__(self, owner: CairnCheckpoint, trainer: pl.Trainer) -> None:
        self._owner = owner
        self._trainer = trainer
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return self._owner._state(self._trainer)

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


def _check_strategy(trainer: pl.Trainer) -> None:
    strategy = trainer.strategy
    # Sharded strategies restore after setup and hold parameters the module's state_dict
    # does not describe; cairn does not reshard.
    if (not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
            or strategy.restore_checkpoint_after_setup):
        raise ConfigError(f"CairnCheckpoint supports single-device and DDP training, not "
                          f"{type(strategy).__name__}")
