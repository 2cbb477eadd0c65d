"""The writer process: persists staged snapshots so training only pays for a copy.

The trainer (:class:`WriterProcess`) and the writer process talk over a Unix socket pair with
length-prefixed JSON messages; staging buffers travel as file descriptors (SCM_RIGHTS). The
writer process owns the attempt's appends from its start: it chunks, hashes, dedups and
commits each staged snapshot, and reports ``committed`` or ``failed`` per snapshot.

A writer process that dies is noticed by the trainer (end of stream), which logs the error,
keeps training, and starts a new writer at the next snapshot; the new one adopts any record the
dead one committed without reporting (``Store.resume_attempt``). A snapshot it had not
committed is simply absent: nothing partial is ever visible. The writer runs in its own session
and ignores SIGTERM, so a signal sent to the trainer's process group (or, under SLURM, to every
process of the job) does not kill it mid-persist; it exits when the trainer's end of the socket
closes, after finishing what it is doing. A process the trainer forks (a DataLoader worker)
closes its copy of the trainer's end at once (:func:`_drop_trainer_ends`): a copy left open
kept the writer alive after the trainer died, for as long as the fork lived.

The writer yields to training: it runs under ``SCHED_IDLE`` (else at ``nice`` 19) and at the
lowest best-effort I/O priority, so hashing and writing a snapshot take the cores and disk time
training leaves idle rather than slowing its steps (see :func:`lower_priority`).

Run as ``python -m cairn.state.writer_process FD [NICE]``; it imports neither torch nor the trainer's
code.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cairn.exceptions import CairnError, Fenced
from cairn.state.codec import STATE_FILE, tensor_path
from cairn.store import Secret, secret_text

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


class _Receiver:
    """Reassembles frames; descriptors are queued in arrival order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = bytearray()
        self.fds: deque[int] = deque()

    def next(self) -> dict[str, Any] | None:
        while True:
            if len(self.data) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(self.data)
                if len(self.data) >= _HEADER.size + length:
                    body = bytes(self.data[_HEADER.size:_HEADER.size + length])
                    del self.data[:_HEADER.size + length]
                    return json.loads(body)
            chunk, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 8)
            if not chunk:
                return None
            self.data += chunk
            self.fds.extend(fds)


# -- the writer process ------------------------------------------------------------------------

def serve(sock: socket.socket) -> int:
    """The writer process's loop. Returns its exit code."""
    from cairn.state.staging import map_shared
    from cairn.runtime.stores import open_store
    from cairn.store import Key, SnapshotMode, StoreSettings, secret_from_text

    receiver = _Receiver(sock)
    init = receiver.next()
    if init is None or init.get("op") != "init":
        return 2
    secret = init.get("secret")
    store = open_store(init["store"], settings=StoreSettings(**init.get("settings", {})),
                       secret=secret_from_text(secret, source="the trainer's secret")
                       if secret else None)
    key = Key(tuple(init["key"]))
    attempt = store.resume_attempt(key, epoch=init["epoch"], last_seq=init["last_seq"],
                                   parent_seq=init.get("parent_seq"))
    _send(sock, {"op": "ready", "last_seq": attempt.log.last_seq, "fenced": attempt.fenced})
    buffers: dict[int, Any] = {}
    while True:
        message = receiver.next()
        if message is None or message["op"] == "close":
            break
        op = message["op"]
        if op == "buffer":
            old = buffers.pop(message["id"], None)
            if old is not None:
                old.close()
            fd = receiver.fds.popleft()
            buffers[message["id"]] = map_shared(fd, message["capacity"])
            os.close(fd)
            continue
        try:
            if op == "persist":
                started = time.monotonic()
                view = memoryview(buffers[message["buffer"]])
                try:
                    with attempt.snapshot(mode=SnapshotMode.STATE) as snap:
                        for index, (offset, nbytes) in enumerate(message["slots"]):
                            snap.add_bytes(tensor_path(index), view[offset:offset + nbytes])
                        snap.add_bytes(STATE_FILE, json.dumps(message["index"]).encode())
                        part = message.get("part")
                        if part is None:
                            manifest = snap.commit(step=message["step"])
                        else:
                            manifest = snap.commit_part(seq=part["seq"], rank=part["rank"],
                                                        step=message["step"])
                finally:
                    view.release()
                if part is not None and part["rank"] == 0:
                    manifest = _commit_when_all_parts(attempt, part, message["step"])
                _send(sock, {"op": "committed", "buffer": message["buffer"], "seq": manifest.seq,
                             "step": manifest.step, "bytes_written": manifest.bytes_written,
                             "seconds": time.monotonic() - started})
            elif op == "finish":
                attempt.finish()
                _send(sock, {"op": "finished"})
        except (CairnError, OSError) as e:
            _send(sock, {"op": "failed", "buffer": message.get("buffer"), "error": str(e),
                         "fenced": isinstance(e, Fenced)})
    store.close()
    return 0


PART_WAIT_SECONDS = 600.0


def _commit_when_all_parts(attempt: Any, part: dict[str, int], step: int) -> Any:
    """Rank 0's writer: wait for every rank's part of ``part["seq"]``, then commit the snap."""
    from cairn.exceptions import PartsMissing

    deadline = time.monotonic() + min(PART_WAIT_SECONDS, attempt.store.gc_grace_seconds / 4)
    while True:
        try:
            return attempt.commit_parts(part["seq"], world_size=part["world_size"], step=step)
        except PartsMissing:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


WRITER_NICE = 19
# ioprio_set(2) has no libc wrapper; its number differs per architecture.
_IOPRIO_SET = {"x86_64": 251, "amd64": 251, "aarch64": 30, "arm64": 30}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_LOWEST_LEVEL = 2, 13, 7


def lower_priority(nice: int) -> None:
    """Make the calling thread, and every thread it starts later, yield to the trainer.

    CPU: the ``SCHED_IDLE`` policy where the kernel has it, else ``nice`` more. Both give the
    writer a small share of a core the trainer wants and all of an idle one, but only
    ``SCHED_IDLE`` makes a waking trainer thread preempt the writer at once: with ``nice`` alone
    a trainer thread leaving an OpenMP barrier can wait out the writer's time slice, and every
    other thread of the parallel region waits with it. ``SCHED_IDLE`` needs no privilege (only
    leaving it does) and still runs the writer, slowly, on a core that is never idle, so a
    snapshot is never starved for ever. I/O: the lowest level of the best-effort class, not the
    idle class, which a busy disk (a data loader) can starve for ever, leaving a snapshot never
    durable. All best effort: a failure leaves the default priority. Linux applies these per
    thread, so this must run before any thread (the store's pool, BLAKE3's) starts.
    """
    if nice > 0:
        try:
            os.nice(nice)
        except OSError as e:
            log.debug("nice(%d) failed: %s", nice, e)
        idle = getattr(os, "SCHED_IDLE", None)
        if idle is not None:
            try:
                os.sched_setscheduler(0, idle, os.sched_param(0))
            except OSError as e:
                log.debug("SCHED_IDLE unavailable: %s", e)
    number = _IOPRIO_SET.get(platform.machine().lower())
    if number is None or not sys.platform.startswith("linux"):
        return
    value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | _IOPRIO_LOWEST_LEVEL
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, _IOPRIO_WHO_PROCESS, 0, value) != 0:
            log.debug("ioprio_set failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        log.debug("ioprio_set unavailable: %s", e)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="cairn-writer: %(message)s")
    # The trainer's socket, not a signal, ends this process. A SIGTERM sent to every process
    # of the job (SLURM does, not only to the process group) must not cut a final snapshot
    # short; SIGKILL still ends it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lower_priority(int(args[1]) if len(args) > 1 else WRITER_NICE)
    sock = socket.socket(fileno=int(args[0]))
    try:
        return serve(sock)
    finally:
        sock.close()


# -- the trainer's side ------------------------------------------------------------------------

@dataclass
class PersistResult:
    step: int
    seq: int | None = None
    error: str | None = None
    fenced: bool = False
    bytes_written: int = 0
    seconds: float = 0.0


@dataclass
class _State:
    busy: set[int] = field(default_factory=set)
    results: list[PersistResult] = field(default_factory=list)
    last_seq: int = 0
    fenced: bool = False
    alive: bool = False


# The trainer's live writers, whose socket ends a forked child must not keep.
_WRITERS: weakref.WeakSet[WriterProcess] = weakref.WeakSet()


def _drop_trainer_ends() -> None:
    """In a child forked from the trainer (a DataLoader worker): close its copies of the
    trainer's ends of the writers' sockets. The writer exits at the end of its stream, which
    never came while a copy was open: a worker whose main process was SIGKILLed while holding
    a lock of theirs (torch's workers then wait forever) kept the writer, and every pipe it
    holds, alive."""
    try:
        writers = list(_WRITERS)
    except RuntimeError:  # the set was changing in the parent at the fork: nothing to trust
        return
    for writer in writers:
        sock, writer._sock = writer._sock, None
        if sock is not None:
            sock.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_trainer_ends)


class WriterProcess:
    """The trainer's handle on the writer process. Methods are called from the training
    thread; a background thread reads the writer's reports."""

    def __init__(self, *, store_url: str, key: tuple[str, ...], epoch: int, last_seq: int,
                 parent_seq: int | None, settings: dict[str, Any] | None = None,
                 nice: int = WRITER_NICE, secret: Secret | None = None) -> None:
        # The secret goes over the private socket (never argv or the environment), so the
        # writer opens the trainer's store whichever way the trainer got its secret.
        self._init = {"op": "init", "store": store_url, "key": list(key), "epoch": epoch,
                      "parent_seq": parent_seq, "settings": settings or {},
                      "secret": secret_text(secret) if secret is not None else None}
        self._nice = nice
        self._state = _State(last_seq=last_seq)
        self._cond = threading.Condition()
        self._buffers: dict[int, tuple[int, int]] = {}  # id -> (fd, capacity)
        self._steps: dict[int, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._finished = threading.Event()
        self._finish_error: tuple[str, bool] | None = None
        self._cancelled = False
        self._pending: subprocess.Popen[bytes] | None = None  # spawned, handshake not done

    # -- process lifecycle ---------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def spawn(self) -> None:
        """Start the writer process without waiting until it is ready; :meth:`start` (or the
        first persist) then completes the handshake, on any thread.

        Call this on the thread that may fork (the training thread, where a DataLoader forks
        its workers): ``Popen`` waits for its exec-status pipe to close, and a process forked
        meanwhile by another thread inherits that pipe and keeps it open while it lives.
        """
        with self._cond:
            if self._state.alive or self._pending is not None:
                return
            if self._cancelled:
                raise CairnError("the cairn writer process was not started: closing")
            last_seq = self._state.last_seq
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cairn.state.writer_process", str(child.fileno()),
                 str(self._nice)],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        with self._cond:
            self._proc = proc
            cancelled = self._cancelled
        if cancelled:
            proc.kill()
        if self._sock is not None:
            self._sock.close()  # a dead writer's
        self._sock = parent
        _WRITERS.add(self)
        self._pending = proc
        try:
            _send(parent, {**self._init, "last_seq": last_seq})
        except OSError:
            pass  # it died at once: the handshake reports it

    def start(self) -> None:
        """Start the writer process now rather than at the first persist, and wait until it
        is ready. Raises CairnError if it cannot start (or :meth:`cancel_start` was called)."""
        self._ensure_running()

    def cancel_start(self) -> None:
        """From another thread: make a :meth:`start` in progress fail at once. Its process is
        killed, which is safe because it has not been asked to persist anything yet."""
        with self._cond:
            self._cancelled = True
            proc = None if self._state.alive else self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _ensure_running(self) -> None:
        with self._cond:
            if self._state.alive:
                return
        if self._pending is None:
            self.spawn()
        proc, self._pending = self._pending, None
        parent = self._sock
        assert proc is not None and parent is not None
        receiver = _Receiver(parent)
        try:
            ready = receiver.next()
        except OSError:
            ready = None
        if ready is None or ready.get("op") != "ready":
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            parent.close()
            self._sock = None
            raise CairnError("the cairn writer process failed to start")
        with self._cond:
            self._state.alive = True
            self._state.last_seq = ready["last_seq"]
            self._state.fenced = self._state.fenced or ready["fenced"]
        for buffer_id, (fd, capacity) in self._buffers.items():
            _send(parent, {"op": "buffer", "id": buffer_id, "capacity": capacity}, [fd])
        threading.Thread(target=self._read_reports, args=(receiver, proc), daemon=True,
                         name="cairn-writer-reports").start()

    def _read_reports(self, receiver: _Receiver, proc: subprocess.Popen[bytes]) -> None:
        while True:
            try:
                message = receiver.next()
            except OSError:
                message = None
            if message is None:
                code = proc.wait()
                with self._cond:
                    if self._proc is proc:
                        self._state.alive = False
                        for buffer_id in list(self._state.busy):
                            step = self._steps.pop(buffer_id, -1)
                            self._state.results.append(PersistResult(
                                step, error=f"the writer process exited (code {code}) before "
                                            f"committing step {step}"))
                        self._state.busy.clear()
                        self._cond.notify_all()
                return
            with self._cond:
                op = message["op"]
                if op == "finished":
                    self._finished.set()
                    continue
                buffer_id = message.get("buffer")
                step = self._steps.pop(buffer_id, -1)
                if op == "committed":
                    self._state.last_seq = message["seq"]
                    self._state.results.append(PersistResult(
                        step, seq=message["seq"], bytes_written=message["bytes_written"],
                        seconds=message["seconds"]))
                else:
                    self._state.fenced = self._state.fenced or message.get("fenced", False)
                    self._state.results.append(PersistResult(
                        step, error=message["error"], fenced=message.get("fenced", False)))
                    if buffer_id is None:  # the finish request failed
                        self._finish_error = (message["error"], message.get("fenced", False))
                        self._finished.set()
                self._state.busy.discard(buffer_id)
                self._cond.notify_all()

    # -- the trainer's calls -------------------------------------------------------------

    def register_buffer(self, buffer_id: int, fd: int, capacity: int) -> None:
        """Hand a (new or replaced) staging buffer to the writer. It must not be busy."""
        self._buffers[buffer_id] = (fd, capacity)
        with self._cond:
            alive = self._state.alive
        if alive and self._sock is not None:
            _send(self._sock, {"op": "buffer", "id": buffer_id, "capacity": capacity}, [fd])

    def is_busy(self, buffer_id: int) -> bool:
        with self._cond:
            return buffer_id in self._state.busy

    def wait_free(self, buffer_ids: list[int], timeout: float | None = None) -> int | None:
        """Block until one of ``buffer_ids`` is free; returns it (None on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: any(b not in self._state.busy for b in buffer_ids),
                                timeout)
            return next((b for b in buffer_ids if b not in self._state.busy), None)

    @property
    def last_seq(self) -> int:
        """The attempt's last seq as the writer last reported it."""
        with self._cond:
            return self._state.last_seq

    def persist(self, buffer_id: int, *, step: int, index: dict[str, Any],
                slots: list[tuple[int, int]], part: dict[str, int] | None = None) -> None:
        """Ask the writer to persist what is staged in ``buffer_id``; returns at once.

        ``part`` (``seq``, ``rank``, ``world_size``) makes it one rank's part of a distributed
        snapshot; rank 0's writer then waits for every part and commits the snapshot."""
        self._ensure_running()
        with self._cond:
            self._state.busy.add(buffer_id)
            self._steps[buffer_id] = step
        assert self._sock is not None
        _send(self._sock, {"op": "persist", "buffer": buffer_id, "step": step, "index": index,
                           "slots": [list(s) for s in slots], "part": part})

    def take_results(self) -> list[PersistResult]:
        """Reports that arrived since the last call (committed or failed snapshots)."""
        with self._cond:
            results, self._state.results = self._state.results, []
            return results

    @property
    def fenced(self) -> bool:
        with self._cond:
            return self._state.fenced

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is being persisted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._state.busy, timeout)

    def finish(self, timeout: float | None = None) -> None:
        """Create the key's ``done`` record through the writer (it owns the attempt)."""
        self.wait_idle()
        self._ensure_running()
        self._finished.clear()
        self._finish_error = None
        assert self._sock is not None
        _send(self._sock, {"op": "finish"})
        if not self._finished.wait(timeout):
            raise CairnError("the writer process did not confirm the done record")
        if self._finish_error is not None:
            error, fenced = self._finish_error
            raise Fenced(error) if fenced else CairnError(f"finishing failed: {error}")

    def close(self) -> None:
        """Wait for in-flight persists, then stop the writer process."""
        self.wait_idle()
        if self._sock is not None:
            try:
                _send(self._sock, {"op": "close"})
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    sys.exit(main())
