"""DataLoader workers' RNGs saved with torchdata ``StatefulDataLoader``'s worker state.

A map-style dataset that draws augmentation from the global RNGs (``torch.randn``,
``numpy.random``, ``random``; torchvision's random transforms do) changes those RNGs inside
each worker process, where the training process's snapshot cannot see them.
``StatefulDataLoader`` already sends each worker's dataset ``state_dict()`` to the main process
with the batches and hands it back to the new worker on resume. :func:`install` puts a
``worker_init_fn`` on the loader that, inside each worker, makes the worker's copy of the
dataset report the worker's RNG states (:mod:`cairn.state.rng`) next to its own state, and put
them back after its own state on load. So the worker state the loader saves for the last
batch it yielded holds exactly the RNGs that the next batch's ``__getitem__`` draws from, with
``persistent_workers`` on (workers keep their RNGs across epochs) and off (new workers are
seeded from the base seed the loader saves).

In the training process, :func:`resume_iterator` creates the restored loader's iterator right
away, so the caller can set the global RNGs *after* it: creating a DataLoader iterator draws
its base seed from the global torch RNG, a draw the uninterrupted run made at the start of
the epoch, not mid-epoch. :func:`diagnose` names what stops a resume from being bit-identical.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

MARK = "cairn.worker_rng"  # the key under which a worker's dataset state carries its RNGs

__all__ = ["MARK", "diagnose", "install", "is_stateful_loader", "log_if_not_exact",
           "resume_iterator", "torchdata_available"]


class WorkerRNG:
    """``worker_init_fn`` that runs the user's own first, then wraps the worker's dataset.

    Picklable (a module-level class holding the user's function), so it also works with the
    ``spawn`` and ``forkserver`` start methods.
    """

    def __init__(self, previous: Any = None) -> None:
        self.previous = previous

    def __call__(self, worker_id: int) -> None:
        if self.previous is not None:
            self.previous(worker_id)
        from torch.utils.data import IterableDataset, get_worker_info

        info = get_worker_info()
        if info is None or isinstance(info.dataset, IterableDataset):
            # torchdata fast-forwards an IterableDataset that saves no state, replaying its
            # draws from the freshly seeded worker RNGs; a state here would stop that replay.
            return
        _wrap(info.dataset)


def _wrap(dataset: Any) -> None:
    own_state = getattr(dataset, "state_dict", None)
    own_load = getattr(dataset, "load_state_dict", None)

    def state_dict() -> dict[str, Any]:
        from cairn.state import rng

        return {MARK: rng.capture(cuda=False),
                "dataset": own_state() if own_state is not None else None}

    def load_state_dict(state: Any) -> None:
        from cairn.state import rng

        if not (isinstance(state, dict) and MARK in state):
            if own_load is not None:
                own_load(state)  # a state saved without cairn's hook
            return
        if state.get("dataset") is not None and own_load is not None:
            own_load(state["dataset"])
        rng.restore(state[MARK])  # last: the dataset's own load may draw

    try:
        # On the worker's own copy of the dataset only; torchdata finds state_dict through
        # its runtime-checkable Stateful protocol, which instance attributes satisfy.
        object.__setattr__(dataset, "state_dict", state_dict)
        object.__setattr__(dataset, "load_state_dict", load_state_dict)
    except (AttributeError, TypeError):
        pass  # a slotted or frozen dataset: diagnose() reports the missing worker RNGs


def torchdata_available() -> bool:
    """Whether torchdata's ``StatefulDataLoader`` can be imported."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return StatefulDataLoader is not None


def is_stateful_loader(loader: Any) -> bool:
    """Whether ``loader`` is torchdata's ``StatefulDataLoader`` (False without torchdata)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


def install(loader: Any) -> bool:
    """Put :class:`WorkerRNG` on a ``StatefulDataLoader`` with workers (idempotent). Returns
    whether the loader's workers will save their RNGs: False for another loader, no workers,
    or persistent workers that are already running."""
    if not is_stateful_loader(loader) or loader.num_workers == 0:
        return False
    if isinstance(loader.worker_init_fn, WorkerRNG):
        return True
    if loader._iterator is not None and loader.persistent_workers:
        return False  # its workers started without the hook and will be reused
    loader.worker_init_fn = WorkerRNG(loader.worker_init_fn)
    return True


def resume_iterator(loader: Any) -> None:
    """Create a restored ``StatefulDataLoader``'s iterator now (its workers start, restored);
    the next ``iter(loader)`` returns it. Does nothing for other loaders or a fresh one."""
    if is_stateful_loader(loader) and loader.next_iter_state is not None:
        loader.state_dict()  # creates the iterator from next_iter_state and keeps it for iter()


def diagnose(loader: Any, state: Any) -> list[str]:
    """Why resuming ``loader`` from ``state`` (the loader state a snapshot holds; None if it
    holds none) is not bit-identical with the uninterrupted run; empty when nothing is known
    to stop it."""
    from torch.utils.data import IterableDataset, SequentialSampler

    if loader is None:
        return []
    if not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
        return [f"the {type(loader).__name__} cannot save its position: the epoch restarts "
                "from its first batch (use torchdata's StatefulDataLoader)"]
    reasons: list[str] = []
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and not hasattr(dataset, "state_dict"):
        reasons.append(f"the IterableDataset {type(dataset).__name__} saves no state: torchdata "
                       "replays it from the start of the epoch, exact only if its randomness "
                       "comes from the worker's seeded global RNGs")
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and not isinstance(sampler, SequentialSampler) \
            and not hasattr(sampler, "state_dict") and is_stateful_loader(loader) \
            and not _is_torchdata_sampler(sampler):
        reasons.append(f"the sampler {type(sampler).__name__} has no state_dict: its order is "
                       "replayed by skipping indices, exact only if iter(sampler) is "
                       "deterministic")
    if is_stateful_loader(loader) and loader.num_workers > 0 \
            and not isinstance(dataset, IterableDataset) and isinstance(state, dict):
        workers = _worker_states(state)
        if workers is not None and not all(
                isinstance(w, dict) and isinstance(w.get("dataset_state"), dict)
                and MARK in w["dataset_state"] for w in workers):
            reasons.append("the snapshot holds no RNG state for the DataLoader workers (its "
                           "workers started before cairn could hook them): augmentation drawn "
                           "in workers is re-seeded")
    return reasons


def _is_torchdata_sampler(sampler: Any) -> bool:
    # torchdata's samplers save their position; an IterableDataset's placeholder sampler
    # (torch's _InfiniteConstantSampler) has nothing to save.
    return type(sampler).__module__.startswith("torchdata.") \
        or type(sampler).__name__ == "_InfiniteConstantSampler"


def _worker_states(state: dict[str, Any]) -> list[Any] | None:
    snapshot = state.get("_snapshot")
    if not isinstance(snapshot, dict):
        return None
    workers = snapshot.get("_worker_snapshots")
    return list(workers.values()) if isinstance(workers, dict) else None


def log_if_not_exact(reasons: list[str], *, what: str = "this resume") -> None:
    """Log, in one line, why ``what`` is not bit-identical (nothing when ``reasons`` is empty)."""
    if reasons:
        log.warning("%s is not bit-identical: %s", what, "; ".join(reasons))
