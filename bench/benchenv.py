"""What every bench script needs: the page cache, the load, durable files, where time goes.

Imported by the bench scripts as ``benchenv`` (``bench/`` is on ``sys.path`` when a script in
it runs).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class BenchError(RuntimeError):
    """A side failed or did not verify: the bench stops rather than print a figure for it."""


def wait_for(predicate: Callable[[], T], timeout: float, what: str, *,
             poll_s: float = 0.02) -> T:
    """``predicate()``'s first true value, polled every ``poll_s``; BenchError after
    ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll_s)


def read(path: str) -> str:
    """The text of ``path`` ('' when it cannot be read: not there yet, or gone)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def drop_caches() -> bool:
    """``sync`` then drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def fsync_path(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove a file or a tree, if it is there."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


# -- where time goes ----------------------------------------------------------------------------


class Timers:
    """Seconds spent per activity, from any thread, split into the calling thread's and the
    others' (a pool's): only the calling thread's add up to the wall time of what it ran;
    the pool's overlap it and each other, so they are reported apart, as busy time."""

    def __init__(self) -> None:
        self.caller = threading.get_ident()
        self.main: dict[str, float] = {}
        self.pool: dict[str, float] = {}
        self._lock = threading.Lock()
        self._depth = threading.local()

    def add(self, name: str, seconds: float) -> None:
        table = self.main if threading.get_ident() == self.caller else self.pool
        with self._lock:
            table[name] = table.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def timing(self, name: str) -> Iterator[None]:
        """Time the block as ``name``, unless it runs inside another timed block on this
        thread (a timed fsync inside a timed fsync_dir): each second is counted once."""
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth.value = depth
            if depth == 0:
                self.add(name, time.perf_counter() - start)

    def timed(self, name: str, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` with every call's time added to ``name``."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            with self.timing(name):
                return fn(*args, **kwargs)
        return wrapper


@contextlib.contextmanager
def timed_attributes(timers: Timers, targets: Iterable[tuple[Any, str, str]]) -> Iterator[None]:
    """Time every call of ``owner.attribute`` (a module's function, a class's or one object's
    method) as activity ``name`` while the block runs, for each ``(owner, attribute, name)``.
    A target that is missing (the library moved it) is skipped: that part reads 0 and the
    breakdown's ``other`` grows, rather than the bench failing."""
    undo: list[Callable[[], None]] = []
    try:
        for owner, attribute, name in targets:
            own = attribute in vars(owner)
            if not own and not hasattr(owner, attribute):
                continue
            # A class's own entry is the plain function (it binds again when wrapped); an
            # object's or a module's is what getattr gives.
            raw = vars(owner)[attribute] if own and isinstance(owner, type) \
                else getattr(owner, attribute)
            if isinstance(raw, (staticmethod, classmethod)) or not callable(raw):
                continue
            setattr(owner, attribute, timers.timed(name, raw))
            undo.append(functools.partial(setattr, owner, attribute, raw) if own
                        else functools.partial(delattr, owner, attribute))
        yield
    finally:
        for restore in reversed(undo):
            restore()


def breakdown(total_s: float, parts: dict[str, float], pool: dict[str, float] | None = None,
              *, rest: str = "other") -> dict[str, Any]:
    """``parts`` (seconds on the timed thread) and ``rest`` (what is left of ``total_s``), so
    that the parts add up to the total; ``pool``: busy seconds on other threads, overlapping
    the total (their sum can exceed it)."""
    out: dict[str, Any] = {"total_s": round(total_s, 4)}
    shown = {k: round(v, 4) for k, v in parts.items()}
    shown[rest] = round(total_s - sum(parts.values()), 4)
    out["parts_s"] = shown
    if pool:
        out["pool_busy_s"] = {k: round(v, 4) for k, v in pool.items()}
    return out


def mean_breakdown(runs: list[tuple[float, Timers]], *, rest: str = "other") -> dict[str, Any]:
    """:func:`breakdown` of the mean over ``runs`` (each its total seconds and its Timers)."""
    count = max(1, len(runs))
    total = sum(seconds for seconds, _ in runs) / count

    def mean(table: Callable[[Timers], dict[str, float]]) -> dict[str, float]:
        names = sorted({name for _, timers in runs for name in table(timers)})
        return {n: sum(table(t).get(n, 0.0) for _, t in runs) / count for n in names}

    return breakdown(total, mean(lambda t: t.main), mean(lambda t: t.pool), rest=rest)


def store_write_parts() -> list[tuple[Any, str, str]]:
    """What a cairn store write's breakdown times, for :func:`timed_attributes`."""
    from cairn.store import Store
    from cairn.store.fileops import OsFileOps
    from cairn.store.packs import PackWriter

    return [(Store, "chunk_digest", "hash"), (OsFileOps, "write", "write"),
            (OsFileOps, "open_new", "create"), (OsFileOps, "mkdir", "mkdir"),
            (OsFileOps, "fsync", "fsync"), (OsFileOps, "fsync_dir", "fsync_dir"),
            (OsFileOps, "link", "publish"), (PackWriter, "flush", "wait_for_packs_durable"),
            # private: where a full pack waits for a free sealing slot (back-pressure)
            (PackWriter, "_seal", "seal_pack")]


def store_read_parts() -> list[tuple[Any, str, str]]:
    """What a cairn store read's breakdown times: reads and BLAKE3 checks (on pool threads)."""
    import cairn.store.reader as reader
    from cairn.store.local import LocalBackend

    # A reader takes its digest function when it is made (keyed in an encrypted store).
    return [(LocalBackend, "read_range_into", "read"), (reader, "plain_digest", "verify")]


def print_breakdowns(title: str, parts: dict[str, dict[str, Any]], *, width: int = 28) -> None:
    """One line per side: its total = its parts (+ other) | pool busy time."""
    print(f"where time goes, {title} (seconds; the parts add up to the total; pool: busy time "
          "on other threads, overlapping it):")
    for name, b in parts.items():
        shown = " + ".join(f"{k} {v:.3f}" for k, v in b["parts_s"].items())
        line = f"  {name:<{width}} {b['total_s']:.3f} = {shown}"
        if b.get("pool_busy_s"):
            line += " | pool: " + ", ".join(f"{k} {v:.3f}" for k, v in b["pool_busy_s"].items())
        print(line)


def print_peers(peers: dict[str, str], *, width: int = 28) -> None:
    print("peer configurations:")
    for name, text in peers.items():
        print(f"  {name:<{width}} {text}")
