"""Hugging Face transformers: resume ``Trainer.train`` from a cairn store.

::

    from cairn.integrations.huggingface import train

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    train(trainer, every_steps=200)          # instead of trainer.train(); CAIRN_STORE, CAIRN_KEY

:func:`train` wraps ``trainer.train()``; a :class:`CairnCallback` alone cannot resume, because
only ``Trainer.train(resume_from_checkpoint=DIR)`` makes the training loop skip the epochs and
batches that were already trained (``_inner_training_loop`` computes them from
``trainer_state.json`` before any callback runs, and fast-forwards the dataloader with
accelerate's ``skip_first_batches``). So :func:`train`:

1. creates the optimizer (``trainer.create_optimizer()``, which ``train()`` then reuses) and
   restores the newest snapshot that verifies into the model, the optimizer, the AMP scaler
   and the RNGs; the LR scheduler, which ``train()`` creates, gets its state in
   ``on_train_begin``;
2. writes a scratch directory holding only what transformers needs to find its place: the
   snapshot's ``trainer_state.json`` (JSON: global step, epoch, log history, stateful
   callbacks) and an *empty* ``model.safetensors`` (``train()`` insists on a weights file;
   loading an empty one leaves the restored weights as they are). No ``optimizer.pt``,
   ``scheduler.pt`` or ``rng_state.pth``: nothing is unpickled, and transformers skips what
   is absent;
3. runs ``trainer.train(resume_from_checkpoint=that directory)`` and closes the Checkpointer
   when it returns, every snapshot durable.

The callback snapshots at the start of an optimizer step (``on_step_begin``), which holds the
state after the previous step, its logging and evaluation included, and the RNGs as they are
once that step's batches are fetched. That is the point where transformers' own resume puts
the RNGs back (after fast-forwarding the dataloader), and where the callback puts them back
too: the resumed run continues bit-identically when the uninterrupted one is deterministic.
When training ends it takes a last snapshot of the finished state.

Augmentation drawn from the global RNGs in a map-style dataset's ``__getitem__`` resumes
exactly with ``dataloader_num_workers=0``: the batches of the snapshotted step and the one
accelerate prefetches were fetched before the snapshot, each from the RNGs as the step before
left them. The callback records the RNG states each batch fetch starts from (it sets the
dataset's ``__getitems__``, which torch's fetcher calls once a batch), snapshots those of the
batches fetched but not yet trained, and replays them for the first fetches after a resume.

With ``dataloader_num_workers > 0`` and torchdata installed, augmentation drawn in the workers
resumes exactly too: :mod:`cairn.integrations._hf_loader` makes the train loader a
``StatefulDataLoader`` whose position and workers' RNGs the snapshot holds, and positions it
on resume in place of transformers' ``skip_first_batches`` (without torchdata, training logs at
its start that a resume will not be exact).

Not captured, as with transformers' own resume: the running loss sum between two logging
steps (the first logged loss after a resume averages the steps since the resume), and state a
custom ``Trainer`` subclass keeps in attributes. Refused: DeepSpeed, FSDP, ``model_init`` and ``auto_find_batch_size``.
Single-process training is tested; under DDP every rank runs :func:`train` and writes one
part per rank, as under torchrun, but that has not been run.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

from cairn.exceptions import ConfigError
from cairn.integrations._common import (
    CheckpointingCallback,
    close_quietly,
    make_checkpointer,
    missing,
)

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as _transformers_error:
    raise missing("Hugging Face transformers", "huggingface", _transformers_error) from None

from cairn.integrations._hf_loader import WorkerLoader, unsupported
from cairn.state import capture, loader_workers, rng

log = logging.getLogger(__name__)

STATE_VERSION = 1
TRAINER_STATE_NAME = "trainer_state.json"
WEIGHTS_NAME = "model.safetensors"
# transformers warns that the empty weights file lacks every key; the weights are restored.
_EMPTY_WEIGHTS_WARNING = "There were missing keys in the checkpoint model loaded"

__all__ = ["CairnCallback", "train"]


def train(trainer: Trainer, *, store: Any = None, key: Any = None, checkpointer: Any = None,
          every_steps: int | None = None, every_seconds: float | None = None,
          save_on_end: bool | None = None, finish: bool | None = None,
          **train_kwargs: Any) -> Any:
    """``trainer.train(**train_kwargs)``, resumed from the cairn store when it has a snapshot.

    Uses the :class:`CairnCallback` already on the trainer, or adds one built from the
    arguments (``store``/``key``, a ``checkpointer``, or ``CAIRN_STORE``/``CAIRN_KEY``; see
    :class:`CairnCallback`; for other Checkpointer options, put a configured one on the
    trainer). Returns what ``trainer.train`` returns. Every snapshot is durable when it
    returns; on an exception the Checkpointer is closed and the exception propagates.
    """
    if train_kwargs.get("resume_from_checkpoint") not in (None, False):
        raise ConfigError("resume_from_checkpoint is for transformers' own checkpoints; cairn "
                          "decides where to resume from")
    train_kwargs.pop("resume_from_checkpoint", None)
    callback = next((cb for cb in trainer.callback_handler.callbacks
                     if isinstance(cb, CairnCallback)), None)
    given = (store, key, checkpointer, every_steps, every_seconds, save_on_end, finish)
    if callback is None:
        callback = CairnCallback(store=store, key=key, checkpointer=checkpointer,
                                 every_steps=every_steps, every_seconds=every_seconds,
                                 save_on_end=save_on_end is not False, finish=bool(finish))
        trainer.add_callback(callback)
    elif given != (None,) * len(given):
        raise ConfigError("the trainer already has a CairnCallback; configure it, not train()")
    with contextlib.ExitStack() as cleanup:
        # Made only for a resume: a run killed by SIGKILL leaves its scratch behind, and
        # most runs that are killed were never resumed.
        def scratch() -> str:
            return cleanup.enter_context(tempfile.TemporaryDirectory(prefix="cairn-hf-"))

        try:
            resume_dir = callback._prepare(trainer, scratch)
            with _without(_EMPTY_WEIGHTS_WARNING), callback._loader_active():
                output = trainer.train(resume_from_checkpoint=resume_dir, **train_kwargs)
        except BaseException as e:
            callback._abort(e)
            raise
    callback._end()
    return output


class CairnCallback(CheckpointingCallback, TrainerCallback):
    """Snapshots a ``transformers.Trainer`` into a cairn store; used through :func:`train`.

    Give ``store=`` and ``key=``, or neither to read ``CAIRN_STORE`` and ``CAIRN_KEY``
    (:meth:`cairn.state.Checkpointer.from_env`), or a ready ``checkpointer=``. Other keyword
    options (``policy=``, ``persist=``, ``preemption=``, ...) go to the Checkpointer.
    ``every_steps`` counts optimizer steps. ``save_on_end``: snapshot the finished state when
    training ends, so a retry after a later failure in the same task skips training.
    ``finish``: mark the key done (and drop its snapshots) once training succeeded.
    """

    def _reset(self) -> None:
        self._trainer: Trainer | None = None
        self._optimizer: Any = None
        self._scheduler = _Pending("the LR scheduler")
        self._param_groups: list[dict[str, Any]] | None = None
        self._ledger: _FetchLedger | None = None
        self._workers: WorkerLoader | None = None
        self._start_step = 0

    # -- before trainer.train() --------------------------------------------------------------

    def _prepare(self, trainer: Trainer, make_scratch: Callable[[], str]) -> str | None:
        """Restore into the trainer; return the directory to pass as ``resume_from_checkpoint``
        (None: no snapshot, start fresh), made by ``make_scratch``."""
        if self.checkpointer is not None:
            raise ConfigError("this CairnCallback already ran a training; use a new one per train()")
        _check_supported(trainer)
        ckpt = make_checkpointer(**self._factory)
        # The Trainer's data position (its epoch and steps, what it skips on a resume) is
        # counted in batches of its ranks as they were (issue 35).
        ckpt.resize_refusal = ("cairn's Trainer integration resumes the Trainer's data "
                               "position as its ranks took it, which is not dealt to another "
                               "number of ranks yet")
        self.checkpointer = ckpt
        self._trainer = trainer
        self._optimizer = trainer.create_optimizer()
        self._ledger = _FetchLedger.install(trainer)
        self._workers = WorkerLoader.create(trainer)
        state = _TrainerState(trainer, self)
        scaler = getattr(trainer.accelerator, "scaler", None)
        start = ckpt.restore(model=trainer.model, optimizer=self._optimizer,
                             scheduler=self._scheduler, scaler=scaler,
                             items={"hf_trainer": state})
        if ckpt.restored_from is None:
            # Said now, not only on the first resume, so the fix can come before it is needed.
            loader_workers.log_if_not_exact(_not_exact(trainer, self._ledger, unseen=False),
                                            what="a resume of this Trainer")
            return None
        doc = state.loaded
        if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
            raise ConfigError(f"snapshot seq {ckpt.restored_from.seq} of key {ckpt.key} holds no "
                              "Trainer state this version understands; was it written by "
                              "CairnCallback? (start fresh with: cairn rm STORE KEY)")
        trainer_state = json.loads(doc["trainer_state"])
        if trainer_state.get("global_step") != start:
            raise ConfigError(f"snapshot seq {ckpt.restored_from.seq}: its trainer state is at "
                              f"global step {trainer_state.get('global_step')}, its tensors after "
                              f"step {start - 1}")
        self.restored_step = start - 1
        self._last_global_step = start
        self._start_step = start
        self._rng = capture.rng_state()
        if self._ledger is not None:
            self._ledger.replay = list(doc.get("fetch_rng") or [])
        unseen = "fetch_rng" in doc and doc["fetch_rng"] is None
        reasons = _not_exact(trainer, self._ledger, unseen=unseen)
        if self._workers is not None:
            reasons += self._workers.resume(doc.get("workers"))
        loader_workers.log_if_not_exact(reasons,
                                        what=f"resuming the Trainer at global step {start}")
        # Creating the LR scheduler inside train() sets every group's lr to its step-0 value;
        # transformers' own resume loads the optimizer after that, and so do we, in
        # on_train_begin.
        self._param_groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                              for group in self._optimizer.param_groups]
        scratch = make_scratch()
        with open(os.path.join(scratch, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(doc["trainer_state"])
        from safetensors.torch import save_file

        save_file({}, os.path.join(scratch, WEIGHTS_NAME))
        log.info("key %s: Trainer resumes at global step %d", ckpt.key, start)
        return scratch

    # -- inside trainer.train() --------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None:
            raise ConfigError("CairnCallback resumes only through "
                              "cairn.integrations.huggingface.train(trainer): call it instead of "
                              "trainer.train()")
        trainer = self._trainer
        self._scheduler.attach(trainer.lr_scheduler)
        if self._param_groups is not None:
            for group, saved in zip(self._optimizer.param_groups, self._param_groups):
                group.update(saved)
            self._param_groups = None
        if self.restored_step is not None and state.global_step != self.restored_step + 1:
            raise ConfigError(f"transformers resumed at global step {state.global_step}, the "
                              f"snapshot holds step {self.restored_step}: this transformers "
                              "version does not take its place from trainer_state.json")

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._workers is not None:
            self._workers.epoch_begins()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._workers is not None:
            self._workers.step_ended()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._rng is not None:
            capture.set_rng_state(self._rng)
            self._rng = None
        step = state.global_step
        if step == self._last_global_step:
            return  # nothing trained since the start, or since the snapshot resumed from
        self._last_global_step = step
        if self.checkpointer.step(step - 1):
            self.saved_step = step - 1

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step - 1
        if (self.save_on_end and not self.finish and step >= 0
                and step not in (self.saved_step, self.restored_step)):
            self.checkpointer.save(step, wait=True)
            self.saved_step = step

    # -- after trainer.train() ---------------------------------------------------------------

    def _end(self) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        try:
            if self.finish:
                ckpt.finish()
        except BaseException as e:
            close_quietly(ckpt, e)
            raise
        ckpt.close()  # raises if the last snapshot failed

    def _loader_active(self) -> Any:
        return self._workers.active() if self._workers is not None else contextlib.nullcontext()

    def _abort(self, reason: BaseException) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            close_quietly(ckpt, reason)


class _TrainerState:
    """The Trainer's own state, a named item of the Checkpointer (``items=``: read only when a
    snapshot is taken): ``TrainerState``
    as the JSON transformers writes to ``trainer_state.json``, with the stateful callbacks
    (``ExportableState``, ``TrainerControl``) as they are now, as ``_save_checkpoint`` does."""

    def __init__(self, trainer: Trainer, owner: CairnCallback) -> None:
        self._trainer = trainer
        self._owner = owner
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        owner = self._owner
        callbacks: dict[str, Any] = {}
        for callback in trainer.callback_handler.callbacks + [trainer.control]:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if name not in callbacks:
                    callbacks[name] = callback.state()
                elif isinstance(callbacks[name], list):
                    callbacks[name].append(callback.state())
                else:
                    callbacks[name] = [callbacks[name], callback.state()]
        doc = dataclasses.asdict(trainer.state)
        doc["stateful_callbacks"] = callbacks
        # A string, not a tree: it goes back to transformers byte for byte.
        fetch_rng: list[Any] | None = []
        if owner._ledger is not None:
            trained = (trainer.state.global_step - owner._start_step) \
                * trainer.args.gradient_accumulation_steps
            # No fetch seen after steps were trained: transformers fetched from another
            # dataset object (it rebuilds a datasets.Dataset to drop unused columns).
            fetch_rng = None if trained > 0 and owner._ledger.fetches == 0 \
                else owner._ledger.ahead(trained)
        workers = owner._workers.state() if owner._workers is not None else None
        return {"version": STATE_VERSION, "transformers": transformers.__version__,
                "trainer_state": json.dumps(doc, sort_keys=True), "fetch_rng": fetch_rng,
                "workers": workers}

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


class _FetchLedger:
    """The global RNG states each batch fetch of the train dataset started from, in the
    training process (``dataloader_num_workers=0``), and those to put back for the first
    fetches after a resume. Installed as the dataset's ``__getitems__``, which torch's map-style
    fetcher calls once per batch."""

    def __init__(self, depth: int) -> None:
        self.fetches = 0
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=depth)
        self.replay: list[dict[str, Any]] = []

    @classmethod
    def install(cls, trainer: Trainer) -> _FetchLedger | None:
        import torch

        dataset = trainer.train_dataset
        if (trainer.args.dataloader_num_workers != 0 or dataset is None
                or isinstance(dataset, torch.utils.data.IterableDataset)
                or not hasattr(dataset, "__getitem__")):
            return None
        # The step's batches plus the one accelerate fetches ahead.
        ledger = cls(trainer.args.gradient_accumulation_steps + 2)
        own = getattr(dataset, "__getitems__", None)

        def getitems(indices: Any) -> Any:
            if ledger.replay:
                rng.restore(ledger.replay.pop(0))
            ledger.recent.append(rng.capture(cuda=False))
            ledger.fetches += 1
            return own(indices) if own is not None else [dataset[i] for i in indices]

        try:
            object.__setattr__(dataset, "__getitems__", getitems)
        except (AttributeError, TypeError):
            return None  # a slotted dataset: _not_exact says so on resume
        return ledger

    def ahead(self, trained: int) -> list[dict[str, Any]]:
        """The states of the fetches beyond the first ``trained`` batches of this process."""
        count = min(max(self.fetches - trained, 0), len(self.recent))
        return list(self.recent)[len(self.recent) - count:] if count else []


def _not_exact(trainer: Trainer, ledger: _FetchLedger | None, *, unseen: bool) -> list[str]:
    """Why resuming this Trainer is not bit-identical (as far as cairn can tell); ``unseen``:
    the run that took the snapshot trained without any batch fetch reaching the hook."""
    import torch

    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        return [f"the IterableDataset {type(trainer.train_dataset).__name__} is replayed from "
                "the start of the epoch by transformers"]
    if trainer.args.dataloader_num_workers:
        why = unsupported(trainer)  # None: the workers' loader is cairn's (_hf_loader)
        return [why] if why is not None else []
    if (ledger is None or unseen) and trainer.train_dataset is not None:
        return ["cairn could not hook the train dataset's batch fetches: augmentation in the "
                "first batches after the resume is drawn from other RNG states"]
    return []


class _Pending:
    """Stands in for an object that ``trainer.train()`` creates later: keeps the restored
    state until :meth:`attach`, then delegates to the real object."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._target: Any = None
        self._state: Any = None

    def state_dict(self) -> Any:
        if self._target is not None:
            return self._target.state_dict()
        if self._state is not None:
            return self._state  # what it will hold (the Checkpointer sizes its buffer early)
        raise ConfigError(f"{self._what} does not exist yet: snapshot from inside train()")

    def load_state_dict(self, state: Any) -> None:
        self._state = state

    def attach(self, target: Any) -> None:
        self._target = target
        if self._state is not None:
            target.load_state_dict(self._state)
            self._state = None


def _check_supported(trainer: Trainer) -> None:
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ConfigError("cairn's Trainer integration does not support DeepSpeed or FSDP: their "
                          "state is sharded and cairn does not reshard")
    if trainer.model_init is not None:
        raise ConfigError("model_init re-creates the model and optimizer inside train(); pass "
                          "model= instead")
    if trainer.args.auto_find_batch_size:
        raise ConfigError("auto_find_batch_size restarts training with another batch size; set "
                          "per_device_train_batch_size instead")


class _without:
    """Drops one known-harmless warning from transformers' trainer logger while active."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._logger = logging.getLogger("transformers.trainer")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self._prefix)

    def __enter__(self) -> None:
        self._logger.addFilter(self)

    def __exit__(self, *exc: object) -> None:
        self._logger.removeFilter(self)
