"""An injected library failure on the reading side of a restore: what cryptography 51 did
(``AESGCM.decrypt_into`` raising ``ValueError: data and buf must not overlap``), never a store
verdict. A restore that meets it must end the try (exit 8, ``RestoreFailed``), skip nothing
and leave every snapshot restorable once the injection is gone.

Where it strikes (``where``):

- ``"part"``: :meth:`SnapshotReader._read_part`, every ranged read of a pack (a state restore,
  ``cairn get``, the fetch of a process snapshot's images);
- ``"chunks"``: :meth:`SnapshotReader.read_chunks`, the pages a streamed eager process restore
  sends to CRIU (and a lazy restore serves); the images fetched before CRIU still read;
- ``"lazy"``: ``read_chunks`` on a lazy restore's own threads only (its fault handler and
  background fillers): the first page a restored task faults on, while CRIU restores it or
  once it runs;
- ``"lazy-fill"``: ``read_chunks`` on the background fillers only, which start once CRIU has
  restored the tree: the failure arrives while the restored workload runs;
- ``"decrypt"``: :meth:`Sealer.open_extent_into`, an encrypted store's decryption (the field
  failure itself).

In this process: :func:`failing_reads`. In a subprocess (``cairn run``, ``cairn get``, a bare
training script, a pod's script, a KFP task): :func:`injecting_env` puts a test-only
``sitecustomize.py`` first on ``PYTHONPATH``, which loads this file by its path and calls
:func:`install` at interpreter start. With ``rank``, only the process whose ``$RANK`` is that
fails (a distributed restore where one rank alone fails).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

INJECTED = "injected library failure: data and buf must not overlap"
WHERE_ENV = "CAIRN_TEST_READ_FAILURE"
RANK_ENV = "CAIRN_TEST_READ_FAILURE_RANK"
_THREADS = {"lazy": ("cairn-uffd", "cairn-lazy-fill-"), "lazy-fill": ("cairn-lazy-fill-",)}
_TARGETS = {"part": ("cairn.store.reader", "SnapshotReader", "_read_part"),
            "chunks": ("cairn.store.reader", "SnapshotReader", "read_chunks"),
            "lazy": ("cairn.store.reader", "SnapshotReader", "read_chunks"),
            "lazy-fill": ("cairn.store.reader", "SnapshotReader", "read_chunks"),
            "decrypt": ("cairn.store.sealing", "Sealer", "open_extent_into")}

_SITECUSTOMIZE = """\
# Test-only (tests/support/read_failure.py): inject a library failure into cairn's reads.
import importlib.util
import os

if os.environ.get({where_env!r}):
    _spec = importlib.util.spec_from_file_location("_cairn_read_failure", {helper!r})
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install(os.environ[{where_env!r}], rank=os.environ.get({rank_env!r}) or None)
"""


def install(where: str = "part", *, rank: str | None = None) -> Callable[[], None]:
    """Make the reads ``where`` names raise ``ValueError(INJECTED)`` in this process (only
    when ``$RANK`` is ``rank``, if given); returns what undoes it."""
    import importlib

    if rank is not None and os.environ.get("RANK", "0") != rank:
        return lambda: None
    module, owner_name, name = _TARGETS[where]
    owner = getattr(importlib.import_module(module), owner_name)
    original = owner.__dict__[name]

    threads = _THREADS.get(where)

    def failing(self: object, *args: object, **kwargs: object) -> object:
        if threads is not None and not threading.current_thread().name.startswith(threads):
            return original(self, *args, **kwargs)
        raise ValueError(INJECTED)

    setattr(owner, name, failing)
    return lambda: setattr(owner, name, original)


@contextmanager
def failing_reads(where: str = "part") -> Iterator[None]:
    """:func:`install` for the duration of the block."""
    undo = install(where)
    try:
        yield
    finally:
        undo()


def injecting_env(directory: Path, *, where: str = "part", rank: str | None = None,
                  base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with the injection on for every Python process
    started with it: a ``sitecustomize.py`` written to ``directory``, placed first on
    ``PYTHONPATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(
        where_env=WHERE_ENV, rank_env=RANK_ENV, helper=str(Path(__file__).resolve())))
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    env[WHERE_ENV] = where
    if rank is not None:
        env[RANK_ENV] = rank
    return env
