"""Gather the state of live training objects into one tree, and put a tree back.

Restore is all-or-nothing: :func:`check_compatible` compares every stored tensor's shape and
dtype (and the optimizers' parameter layout) with the live objects and reports every mismatch
before :func:`apply` copies the first byte. Device placement follows the live objects:
``load_state_dict`` copies into the model's existing (possibly GPU) parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cairn.exceptions import CairnError, ConfigError
from cairn.state import data_position, loader_workers, rng


class StateMismatch(ConfigError):
    """The snapshot does not fit the live model or optimizer (changed architecture?)."""


def named(value: Any, what: str) -> dict[str, Any]:
    """``{"default": obj}`` for one object, the dict itself for several, ``{}`` for None."""
    if value is None:
        return {}
    if isinstance(value, dict):
        for name in value:
            if not isinstance(name, str):
                raise ConfigError(f"{what} names must be strings, got {name!r}")
        return dict(value)
    return {"default": value}


@dataclass
class Targets:
    """The live objects a :class:`~cairn.state.checkpointer.Checkpointer` snapshots."""

    models: dict[str, torch.nn.Module] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    scalers: dict[str, Any] = field(default_factory=dict)
    loader: Any = None
    # Named objects of any kind that follow torch's Stateful protocol (state_dict /
    # load_state_dict), as torch.distributed.checkpoint takes them: a trainer's own state, an
    # EMA, a curriculum. Read when a snapshot is taken, loaded after the schedulers and scalers.
    items: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, model in self.models.items():
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"model {name!r} is a {type(model).__name__}, not a torch.nn.Module")
        for name, opt in self.optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(f"optimizer {name!r} is a {type(opt).__name__}, not a "
                                  "torch.optim.Optimizer")
        for kind, objs in (("scheduler", self.schedulers), ("scaler", self.scalers),
                           ("item", self.items)):
            for name, obj in objs.items():
                if not name:
                    raise ConfigError(f"a {kind}'s name is empty; name each one")
                if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                    raise ConfigError(f"{kind} {name!r} has no state_dict/load_state_dict")
        loader = self.loader
        if loader is not None and not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            raise ConfigError(
                f"loader= is a {type(loader).__name__}, which cannot save its position. Use "
                "torchdata.stateful_dataloader.StatefulDataLoader (a drop-in DataLoader), or pass "
                "any object with state_dict()/load_state_dict() such as a stateful sampler"
            )
        # Before the first iter(loader): workers started without the hook cannot save their
        # RNGs, in this run's snapshots or on a resume.
        loader_workers.install(loader)


def rng_state() -> dict[str, Any]:
    """This process's global RNG states (:func:`cairn.state.rng.capture`)."""
    return rng.capture()


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back :func:`rng_state`'s tree (:func:`cairn.state.rng.restore`)."""
    rng.restore(state)


def gather(targets: Targets, *, step: int, extras: dict[str, Any]) -> dict[str, Any]:
    """The whole state as one tree (tensors are the live ones: copy before training resumes).
    ``items`` appears only when there are some: a tree without them is laid out as before
    named items existed, so such snapshots dedup against older ones."""
    tree = {
        "step": step,
        "models": {n: m.state_dict() for n, m in targets.models.items()},
        "optimizers": {n: o.state_dict() for n, o in targets.optimizers.items()},
        "schedulers": {n: s.state_dict() for n, s in targets.schedulers.items()},
        "scalers": {n: s.state_dict() for n, s in targets.scalers.items()},
        "loader": targets.loader.state_dict() if targets.loader is not None else None,
        "rng": rng_state(),
        "extras": extras,
    }
    if targets.items:
        tree["items"] = {n: item.state_dict() for n, item in targets.items.items()}
    if targets.loader is not None:  # a distributed sampler's place: only where there is one
        position = data_position.capture(targets.loader, tree["loader"])
        if position is not None:
            tree["data"] = position
    return tree


def check_compatible(tree: dict[str, Any], targets: Targets) -> None:
    """Raise :class:`StateMismatch` listing every way the snapshot does not fit."""
    problems: list[str] = []
    for group in ("models", "optimizers", "schedulers", "scalers", "items"):
        stored, live = set(tree.get(group) or {}), set(getattr(targets, group))
        if stored != live:
            problems.append(f"{group}: the snapshot has {sorted(stored)}, you passed {sorted(live)}")
    for name, model in targets.models.items():
        saved = tree.get("models", {}).get(name)
        if saved is None:
            continue
        current = model.state_dict()
        missing, extra = set(current) - set(saved), set(saved) - set(current)
        if missing or extra:
            problems.append(f"model {name!r}: keys missing from the snapshot {sorted(missing)[:5]}, "
                            f"unexpected {sorted(extra)[:5]}")
        for key in set(current) & set(saved):
            a, b = current[key], saved[key]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                if a.shape != b.shape or a.dtype != b.dtype:
                    problems.append(f"model {name!r} {key}: snapshot {tuple(b.shape)} {b.dtype}, "
                                    f"live {tuple(a.shape)} {a.dtype}")
    for name, opt in targets.optimizers.items():
        saved = tree.get("optimizers", {}).get(name)
        if saved is None:
            continue
        live_groups = [len(g["params"]) for g in opt.state_dict()["param_groups"]]
        saved_groups = [len(g["params"]) for g in saved.get("param_groups", [])]
        if live_groups != saved_groups:
            problems.append(f"optimizer {name!r}: snapshot has parameter groups of sizes "
                            f"{saved_groups}, live {live_groups}")
    try:
        rng.check(tree.get("rng"))
    except CairnError as e:
        problems.append(str(e))
    if (tree.get("loader") is None) != (targets.loader is None):
        problems.append("loader: pass the same loader= as when the snapshot was taken")
    if problems:
        raise StateMismatch("the snapshot does not fit the live objects (nothing was loaded):\n  "
                            + "\n  ".join(problems))


def apply(tree: dict[str, Any], targets: Targets) -> None:
    """Load a checked tree into the live objects (after :func:`check_compatible`)."""
    for name, model in targets.models.items():
        model.load_state_dict(tree["models"][name])
    for name, opt in targets.optimizers.items():
        opt.load_state_dict(tree["optimizers"][name])
    for name, sched in targets.schedulers.items():
        sched.load_state_dict(tree["schedulers"][name])
    for name, scaler in targets.scalers.items():
        scaler.load_state_dict(tree["scalers"][name])
    for name, item in targets.items.items():
        item.load_state_dict(tree["items"][name])
    if isinstance(tree["loader"], data_position.Dealt):  # resized: the epoch's rest, afresh
        tree["loader"].apply(targets.loader)
    elif targets.loader is not None:
        data_position.reinstate(targets.loader, tree.get("data"))
        targets.loader.load_state_dict(tree["loader"])
        # Creating the iterator draws from the global RNGs (its base seed); the uninterrupted
        # run drew that at the epoch's start. Create it now, so the RNGs set below stand.
        loader_workers.resume_iterator(targets.loader)
    rng.restore(tree["rng"])
    if targets.loader is not None and not isinstance(tree["loader"], data_position.Dealt):
        loader_workers.log_if_not_exact(loader_workers.diagnose(targets.loader, tree["loader"]),
                                        what=f"resuming at step {tree['step'] + 1}")
