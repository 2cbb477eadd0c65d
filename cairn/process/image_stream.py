"""Serving a restore's images to ``criu restore --stream``: the pages images straight from
verified chunks, with no copy on a scratch disk (ADR 0034).

CRIU's image-streamer protocol (criu/img-streamer.c, CRIU 4.1.1): CRIU connects once to
``IMAGE_DIR/streamer-serve.sock``; per image it sends a request (a native-endian u32 length,
then ``img_streamer_request_entry {required string filename = 1}``), the streamer answers
``img_streamer_reply_entry {required bool exists = 1}`` framed alike, and for an image that
exists CRIU passes the write end of a pipe (SCM_RIGHTS, one dummy byte) and reads the image
from the read end, front to back. Every process CRIU forks shares the one connection under a
lock, so requests arrive one at a time; each image is written by a thread of its own, as CRIU
may hold several open at once.

What is served: the pages images of the snapshot, read window by window with
:meth:`~cairn.store.reader.SnapshotReader.read_chunks` (large ranged reads, page deltas
applied), so no byte of a window reaches the pipe before all of its chunks verified; every
other image from the restore's scratch directory, where the fetch put it (verified) before
CRIU started. A name that is neither (or holds a path separator) is answered
"does not exist". A chunk that fails verification closes its pipe short: CRIU reads an early
end of file and fails the restore, and :attr:`ImageStreamer.failure` holds the
:class:`~cairn.exceptions.CorruptSnapshot` for the caller to raise instead of CRIU's error;
so does any other failure of a writer or the server on this side (a library error, a bug),
as the :class:`~cairn.exceptions.RestoreFailed` that
:func:`~cairn.store.verdicts.as_read_failure` makes of it, so that the restore neither takes
CRIU's short read for a host problem nor skips the snapshot.

Threads: :meth:`start` runs the server on a thread of its own; :meth:`close` may be called
from any thread, once CRIU has exited.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from cairn.exceptions import CairnError, CorruptSnapshot
from cairn.store import Manifest, Store
from cairn.store.aligned import aligned_buffer
from cairn.store.manifest import ChunkRef
from cairn.store.verdicts import as_read_failure

log = logging.getLogger("cairn.run")

SOCKET_NAME = "streamer-serve.sock"  # CRIU's IMG_STREAMER_SERVE_SOCKET_NAME
PIPE_BYTES = 1 << 20  # the default pipe-max-size: fewer wake-ups than the 64 KiB default
# A pages image is read window by window (SnapshotReader.read_chunks: ranged reads spanning
# small holes, deltas patched, all on the store's pool), one window ahead of the pipe.
WINDOW_BYTES = 32 << 20
_LOCAL_READ = 1 << 20
_MAX_REQUEST = 4096


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def parse_request(message: bytes) -> str:
    """The filename of an ``img_streamer_request_entry`` (ValueError when malformed)."""
    at, name = 0, None
    while at < len(message):
        tag, at = _varint(message, at)
        if tag != (1 << 3) | 2:  # field 1, length-delimited: the only field
            raise ValueError(f"unexpected field tag {tag}")
        length, at = _varint(message, at)
        if at + length > len(message):
            raise ValueError("truncated filename")
        name = message[at:at + length].decode()
        at += length
    if name is None:
        raise ValueError("no filename")
    return name


def encode_reply(*, exists: bool) -> bytes:
    """A framed ``img_streamer_reply_entry``."""
    body = bytes([(1 << 3) | 0, 1 if exists else 0])  # field 1, varint
    return struct.pack("=I", len(body)) + body


def _recv_exact(conn: socket.socket, length: int) -> bytes | None:
    """``length`` bytes, or None at a clean end of stream before the first."""
    parts, got = [], 0
    while got < length:
        part = conn.recv(length - got)
        if not part:
            if got == 0:
                return None
            raise ConnectionError("criu closed the image-streamer socket mid-message")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _windows(chunks: Sequence[ChunkRef]) -> list[tuple[ChunkRef, ...]]:
    """``chunks`` cut into consecutive runs of about WINDOW_BYTES."""
    windows: list[tuple[ChunkRef, ...]] = []
    run: list[ChunkRef] = []
    size = 0
    for chunk in chunks:
        run.append(chunk)
        size += chunk.size
        if size >= WINDOW_BYTES:
            windows.append(tuple(run))
            run, size = [], 0
    if run:
        windows.append(tuple(run))
    return windows


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


class ImageStreamer:
    """Serves one restore's images to ``criu restore --stream`` (module docstring)."""

    def __init__(self, *, store: Store, manifest: Manifest, image_dir: str,
                 streamed: Sequence[str], images_prefix: str) -> None:
        self._store = store
        self._manifest = manifest
        self._image_dir = image_dir
        self._streamed = frozenset(streamed)
        self._prefix = images_prefix
        self._listener: socket.socket | None = None
        self._dir_fd: int | None = None
        self._conn: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self.failure: CairnError | None = None  # a CorruptSnapshot or a RestoreFailed
        self.served: list[str] = []  # image names, in the order CRIU asked for them
        self.bytes_streamed = 0

    @property
    def socket_path(self) -> str:
        return os.path.join(self._image_dir, SOCKET_NAME)

    @property
    def criu_dir(self) -> str:
        """The images directory to give CRIU (``-D``) while :meth:`start`-ed: the same
        directory through this process's descriptor of it, as CRIU builds the socket's path
        from ``-D`` and a socket path longer than 107 bytes cannot be connected to."""
        assert self._dir_fd is not None, "start() first"
        return f"/proc/{os.getpid()}/fd/{self._dir_fd}"

    def start(self) -> None:
        """Listen on the socket CRIU connects to; returns once it is bound."""
        self._dir_fd = os.open(self._image_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(self.criu_dir, SOCKET_NAME))
        listener.listen(1)
        self._listener = listener
        thread = threading.Thread(target=self._serve, name="cairn-image-streamer", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _serve(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return  # closed before CRIU connected (CRIU failed early)
        self._conn = conn
        try:
            # Only CRIU, run by this user (root, for process mode), may read the images: any
            # other local process that reached the socket first is refused.
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            if uid != os.geteuid():
                raise ConnectionError(f"a process of uid {uid} connected, not criu")
            while True:
                header = _recv_exact(conn, 4)
                if header is None:
                    return  # CRIU dismissed the streamer: every image was asked for
                (length,) = struct.unpack("=I", header)
                if length > _MAX_REQUEST:
                    raise ValueError(f"request of {length} bytes")
                body = _recv_exact(conn, length)
                if body is None:
                    raise ConnectionError("criu closed the socket mid-request")
                name = parse_request(body)
                exists = self._exists(name)
                conn.sendall(encode_reply(exists=exists))
                if not exists:
                    continue
                _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                if len(fds) != 1:
                    raise ConnectionError(f"criu sent {len(fds)} descriptors for {name}")
                self.served.append(name)
                writer = threading.Thread(target=self._write_image, args=(name, fds[0]),
                                          name=f"cairn-image-{name}", daemon=True)
                with self._lock:
                    if self._closed:
                        os.close(fds[0])
                        return
                    self._threads.append(writer)
                writer.start()
        except (OSError, ValueError, ConnectionError) as e:  # CRIU's side of the protocol
            if not self._closed:
                log.warning("image streamer: %s (criu fails the restore)", e)
        except Exception as e:  # noqa: BLE001 - a bug here: the restore raises it, not CRIU's
            self._failed(e, "serving")
        finally:
            conn.close()

    def _exists(self, name: str) -> bool:
        if "/" in name or name in ("", ".", ".."):
            return False
        if name in self._streamed:
            return True
        return os.path.isfile(os.path.join(self._image_dir, name)) and name != SOCKET_NAME

    def _write_image(self, name: str, fd: int) -> None:
        try:
            try:
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # a smaller pipe only costs wake-ups
            if name in self._streamed:
                self._stream_pages(name, fd)
            else:
                local = os.open(os.path.join(self._image_dir, name),
                                os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    while block := os.read(local, _LOCAL_READ):
                        _write_all(fd, memoryview(block))
                finally:
                    os.close(local)
        except CorruptSnapshot as e:
            self.failure = self.failure or e
            log.error("snapshot seq %d: %s: %s; the restore fails", self._manifest.seq, name, e)
        except OSError as e:
            if e.errno != errno.EPIPE:  # CRIU stopped reading: it failed for its own reason
                log.warning("image streamer: writing %s: %s", name, e)
        except Exception as e:  # noqa: BLE001 - a library error or a bug, not CRIU's short read
            self._failed(e, name)
        finally:
            os.close(fd)

    def _failed(self, error: Exception, what: str) -> None:
        """Record a failure on this side as the restore's (the first one wins)."""
        failure = as_read_failure(error, seq=self._manifest.seq)
        assert isinstance(failure, CairnError)  # neither an OSError nor a BaseException
        with self._lock:
            self.failure = self.failure or failure
        log.error("snapshot seq %d: %s: %s; the restore fails", self._manifest.seq, what,
                  failure, exc_info=error)

    def _stream_pages(self, name: str, fd: int) -> None:
        """Write pages image ``name`` into ``fd`` window by window, each window's chunks read
        (in large ranged reads, page deltas applied) and verified before any of it is written,
        the next window read while this one is written."""
        reader = self._store.reader(self._manifest)
        windows = _windows(self._manifest.file(f"{self._prefix}{name}").chunks)
        if not windows:
            return
        # Two buffers, reused: one is written into the pipe while the next window is read
        # into the other (fresh memory per window faulted in every page of the image).
        spare = [aligned_buffer(max(sum(c.size for c in w) for w in windows)) for _ in range(2)]
        with ThreadPoolExecutor(1, thread_name_prefix=f"cairn-read-{name}") as ahead:
            future: Future[bytearray | memoryview] = ahead.submit(
                reader.read_chunks, windows[0], into=memoryview(spare[0]))
            try:
                for index in range(len(windows)):
                    data = future.result()
                    if index + 1 < len(windows):
                        future = ahead.submit(reader.read_chunks, windows[index + 1],
                                              into=memoryview(spare[(index + 1) % 2]))
                    _write_all(fd, memoryview(data))
                    with self._lock:
                        self.bytes_streamed += len(data)
            finally:
                future.cancel()

    def close(self) -> None:
        """Stop serving, wait for the writers and remove the socket (idempotent). Call once
        CRIU has exited: a writer still blocked on a full pipe ends when CRIU's end closes."""
        with self._lock:
            self._closed = True
        for sock in (self._listener, self._conn):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        for thread in self._threads:
            thread.join(timeout=30)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        if self._dir_fd is not None:
            fd, self._dir_fd = self._dir_fd, None
            os.close(fd)
