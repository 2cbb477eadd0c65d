"""The Hugging Face Trainer's train loader with workers, made resumable exactly.

With ``dataloader_num_workers > 0`` augmentation is drawn from each worker's RNGs, which a
plain ``DataLoader`` neither saves nor restores, and transformers resumes mid-epoch with
accelerate's ``skip_first_batches``, which starts fresh workers on a sampler that skips the
trained batches: every worker draws from other RNG states than in the uninterrupted run.
transformers 5 has no ``use_stateful_dataloader`` option (its ``AcceleratorConfig`` refuses
the key), so while :func:`cairn.integrations.huggingface.train` runs, :class:`WorkerLoader`:

- builds the train loader with accelerate's ``use_stateful_dataloader`` turned on, only inside
  ``trainer.get_train_dataloader()`` (evaluation loaders stay as they are), so it wraps a
  torchdata ``StatefulDataLoader``, and puts :class:`cairn.state.loader_workers.WorkerRNG` on
  it: each worker's RNG states travel inside torchdata's per-worker state;
- keeps the loader's state at every ``on_step_end``: the position after the step's batches,
  before the next step's are fetched (accelerate's ``state_dict()`` already leaves out the batch
  it fetched ahead), and the global RNGs at every ``on_epoch_begin``, before ``iter()`` draws the
  workers' base seed;
- on resume loads that state into the new loader and makes ``transformers.trainer``'s
  ``skip_first_batches`` return this loader as it is (it would rebuild a plain ``DataLoader``):
  the restored iterator continues at the next batch, each worker from its saved RNGs. At an
  epoch boundary without persistent workers the loader starts a fresh epoch instead, from the
  global RNGs the epoch began with, as the uninterrupted run did.

Both replacements are undone when ``train()`` returns. They touch one accelerate setting and
one transformers module name; a version without them is reported, not patched.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from cairn.state import loader_workers, rng

__all__ = ["WorkerLoader", "unsupported"]


def unsupported(trainer: Any) -> str | None:
    """Why the Trainer's map-style train loader with workers cannot be made exact here; None
    when it can, or when there are no workers (the in-process fetches are huggingface's)."""
    workers = trainer.args.dataloader_num_workers
    if not workers:
        return None
    if not loader_workers.torchdata_available():
        return (f"transformers' DataLoader cannot save its {workers} workers' state: "
                "augmentation drawn in workers is seeded anew (install torchdata, whose "
                "StatefulDataLoader cairn then uses, to resume exactly)")
    import transformers.trainer as hf_trainer

    config = getattr(trainer.accelerator, "dataloader_config", None)
    if not hasattr(hf_trainer, "skip_first_batches") \
            or not hasattr(config, "use_stateful_dataloader"):
        return ("this transformers/accelerate pair gives cairn no way to restore the "
                f"{workers} workers' state: augmentation drawn in workers is seeded anew")
    if trainer.args.ignore_data_skip:
        return "ignore_data_skip restarts the epoch's batches from its first"
    return None


class WorkerLoader:
    """The train loader's state for snapshots, and the resume of that state (see the module)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self.loader: Any = None  # accelerate's DataLoaderShard around a StatefulDataLoader
        self._at_step_end: Any = None
        self._epoch_rng: Any = None
        self._pending: dict[str, Any] | None = None  # the snapshot's, until the loader exists
        self._positioned = False
        self._restore_epoch_rng: Any = None

    @classmethod
    def create(cls, trainer: Any) -> WorkerLoader | None:
        """One for a Trainer with workers that :func:`unsupported` accepts; None otherwise."""
        import torch

        if (not trainer.args.dataloader_num_workers or unsupported(trainer) is not None
                or isinstance(trainer.train_dataset, torch.utils.data.IterableDataset)):
            return None
        return cls(trainer)

    # -- snapshot ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"loader": self._at_step_end, "epoch_rng": self._epoch_rng}

    def step_ended(self) -> None:
        if self.loader is not None:
            # A copy: the next batches must not change what the next snapshot holds.
            self._at_step_end = copy.deepcopy(self.loader.state_dict())

    def epoch_begins(self) -> None:
        if self._restore_epoch_rng is not None:
            rng.restore(self._restore_epoch_rng)
            self._restore_epoch_rng = None
        self._epoch_rng = rng.capture()

    # -- resume ------------------------------------------------------------------------------

    def resume(self, saved: Any) -> list[str]:
        """Keep the snapshot's loader state for the loader train() builds; why the resume
        is not exact (empty when it is)."""
        if not (isinstance(saved, dict) and isinstance(saved.get("loader"), dict)):
            return ["the snapshot holds no state of the train loader's workers (it was taken "
                    "without them): augmentation drawn in workers is seeded anew"]
        self._pending = saved
        return []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """While ``trainer.train()`` runs: build the train loader stateful and position it."""
        import transformers.trainer as hf_trainer

        trainer = self._trainer
        build = trainer.get_train_dataloader
        skip = hf_trainer.skip_first_batches

        def get_train_dataloader() -> Any:
            config = trainer.accelerator.dataloader_config
            before, config.use_stateful_dataloader = config.use_stateful_dataloader, True
            try:
                loader = build()
            finally:
                config.use_stateful_dataloader = before
            self._adopt(loader)
            return loader

        def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
            if self._positioned and dataloader is self.loader:
                return dataloader  # the restored iterator continues at the next batch
            return skip(dataloader, num_batches)

        trainer.get_train_dataloader = get_train_dataloader
        hf_trainer.skip_first_batches = skip_first_batches
        try:
            yield
        finally:
            hf_trainer.skip_first_batches = skip
            del trainer.get_train_dataloader

    def _adopt(self, loader: Any) -> None:
        base = getattr(loader, "base_dataloader", None)
        if not loader_workers.is_stateful_loader(base):
            loader_workers.log_if_not_exact(
                [f"the train loader is a {type(base or loader).__name__}, not accelerate's "
                 "around a StatefulDataLoader (a custom get_train_dataloader?): augmentation "
                 "drawn in workers is seeded anew"], what="this Trainer's resume")
            return
        # accelerate's wrapper already started workers (its first state_dict()), without
        # cairn's hook: drop that iterator so that iter() starts hooked ones. The same in every
        # run, so the global RNG draws it costs are the same too.
        base.load_state_dict({})
        loader_workers.install(base)
        self.loader = loader
        saved, self._pending = self._pending, None
        if saved is None:
            return
        state = saved["loader"]
        if state.get("_iterator_finished") and not base.persistent_workers:
            # The epoch had ended: the new one starts fresh workers, seeded from the global
            # RNGs as they were before its iter().
            self._restore_epoch_rng = saved.get("epoch_rng")
            return
        loader.load_state_dict(state)
        self._positioned = True
        if state.get("_iterator_finished"):
            # Persistent workers continue into the next epoch with their RNGs. Restore them now:
            # the restored iterator replays the ended epoch's sampler to its end, which moves
            # accelerate's SeedableRandomSampler to its next epoch, and transformers' set_epoch()
            # before iter() has to come after that, not before.
            loader_workers.resume_iterator(base)
