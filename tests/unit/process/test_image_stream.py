"""The image-streamer server (:mod:`cairn.process.image_stream`) over its real UNIX socket,
pipes and SCM_RIGHTS, against a real local store. The client here is a stand-in for CRIU's
side of the protocol (criu/img-streamer.c: request, reply, then the pipe's write end); the
integration tests (tests/integration/process/test_streamed_restore.py) run real CRIU.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest

from cairn.exceptions import CorruptSnapshot
from cairn.process import image_stream
from cairn.store import Key, Manifest, Store
from cairn import open_store
from tests.support.tamper import flip_byte

PAGES = os.urandom(3 * 1024 * 1024 + 4096)


def request(name: str) -> bytes:
    """An ``img_streamer_request_entry``, framed as CRIU's pb_write_one frames it."""
    raw = name.encode()
    body = b"\x0a" + bytes([len(raw)]) + raw  # field 1, length-delimited (names < 128 bytes)
    return struct.pack("=I", len(body)) + body


class CriuSide:
    """CRIU's end of the protocol (the stand-in): one connection, one image at a time."""

    def __init__(self, socket_path: str) -> None:
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(socket_path)

    def open(self, name: str) -> int | None:
        """The read end of the pipe the image arrives on, None when it does not exist."""
        self.conn.sendall(request(name))
        size = struct.unpack("=I", self.conn.recv(4))[0]
        body = self.conn.recv(size)
        assert body[0] == 0x08  # field 1, varint
        if not body[1]:
            return None
        read_end, write_end = os.pipe()
        socket.send_fds(self.conn, [b"\0"], [write_end])
        os.close(write_end)
        return read_end

    def read(self, name: str) -> bytes:
        fd = self.open(name)
        assert fd is not None, name
        parts = []
        try:
            while part := os.read(fd, 1 << 20):
                parts.append(part)
        finally:
            os.close(fd)
        return b"".join(parts)

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def snapshot(tmp_path: Path) -> tuple[Store, Manifest, Path]:
    source = tmp_path / "pages-1.img"
    source.write_bytes(PAGES)
    store = open_store(str(tmp_path / "store"))
    attempt = store.open_attempt(Key.parse("dag/stream/1"))
    with attempt.snapshot() as snap:
        snap.add_file("images/pages-1.img", str(source))
        manifest = snap.commit(step=1)
    image_dir = tmp_path / "scratch" / "images"
    image_dir.mkdir(parents=True)
    (image_dir / "inventory.img").write_bytes(b"inventory bytes")
    return store, manifest, image_dir


def streamer_for(store: Store, manifest: Manifest, image_dir: Path
                 ) -> image_stream.ImageStreamer:
    streamer = image_stream.ImageStreamer(store=store, manifest=manifest,
                                          image_dir=str(image_dir), streamed=["pages-1.img"],
                                          images_prefix="images/")
    streamer.start()
    return streamer


def test_pages_come_from_the_store_and_small_images_from_the_scratch(snapshot) -> None:
    store, manifest, image_dir = snapshot
    streamer = streamer_for(store, manifest, image_dir)
    criu = CriuSide(os.path.join(streamer.criu_dir, image_stream.SOCKET_NAME))
    try:
        assert criu.read("inventory.img") == b"inventory bytes"
        assert criu.read("pages-1.img") == PAGES
        assert criu.open("pagemap-9.img") is None
        assert criu.open("../store/keys") is None
        assert criu.open(image_stream.SOCKET_NAME) is None
    finally:
        criu.close()
        streamer.close()
    assert streamer.served == ["inventory.img", "pages-1.img"]
    assert streamer.bytes_streamed == len(PAGES) and streamer.failure is None
    assert not (image_dir / image_stream.SOCKET_NAME).exists()


def test_windows_read_into_two_reused_buffers_arrive_whole_and_in_order(snapshot, monkeypatch
                                                                        ) -> None:
    store, manifest, image_dir = snapshot
    monkeypatch.setattr(image_stream, "WINDOW_BYTES", 1 << 20)
    assert len(image_stream._windows(manifest.file("images/pages-1.img").chunks)) >= 3
    streamer = streamer_for(store, manifest, image_dir)
    criu = CriuSide(os.path.join(streamer.criu_dir, image_stream.SOCKET_NAME))
    try:
        assert criu.read("pages-1.img") == PAGES
    finally:
        criu.close()
        streamer.close()
    assert streamer.bytes_streamed == len(PAGES) and streamer.failure is None


def test_a_bad_chunk_ends_the_image_short_and_is_the_failure(snapshot, monkeypatch) -> None:
    store, manifest, image_dir = snapshot
    monkeypatch.setattr(image_stream, "WINDOW_BYTES", 1 << 20)  # windows before the bad one
    chunk = manifest.file("images/pages-1.img").chunks[-1]
    flip_byte(store.backend, chunk.pack, chunk.offset)
    streamer = streamer_for(store, manifest, image_dir)
    criu = CriuSide(os.path.join(streamer.criu_dir, image_stream.SOCKET_NAME))
    try:
        got = criu.read("pages-1.img")
    finally:
        criu.close()
        streamer.close()
    assert 0 < len(got) < len(PAGES) and PAGES.startswith(got), "verified windows, in order"
    assert isinstance(streamer.failure, CorruptSnapshot)
    assert chunk.digest in str(streamer.failure)


def test_the_socket_is_reachable_however_long_the_scratch_path(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100) / ("e" * 100)
    deep.mkdir(parents=True)
    store = open_store(str(tmp_path / "store"))
    streamer = image_stream.ImageStreamer(store=store, manifest=None,  # type: ignore[arg-type]
                                          image_dir=str(deep), streamed=[],
                                          images_prefix="images/")
    assert len(streamer.socket_path) > 108  # more than sun_path holds
    (deep / "inventory.img").write_bytes(b"x")
    streamer.start()
    criu = CriuSide(os.path.join(streamer.criu_dir, image_stream.SOCKET_NAME))
    try:
        assert criu.read("inventory.img") == b"x"
    finally:
        criu.close()
        streamer.close()


@pytest.mark.parametrize("message", [b"", b"\x12\x01a", b"\x0a\x05ab", b"\x0a\x80"])
def test_a_malformed_request_is_refused(message: bytes) -> None:
    with pytest.raises(ValueError):
        image_stream.parse_request(message)


def criu_messages():  # noqa: ANN201 - the two generated message classes
    """CRIU's images/img-streamer.proto, built with the protobuf runtime."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field_proto = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="img-streamer.proto", syntax="proto2")
    for name, field, kind in (("img_streamer_request_entry", "filename", "TYPE_STRING"),
                              ("img_streamer_reply_entry", "exists", "TYPE_BOOL")):
        message = proto.message_type.add(name=name)
        message.field.add(name=field, number=1, label=field_proto.LABEL_REQUIRED,
                          type=getattr(field_proto, kind))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
                 for name in ("img_streamer_request_entry", "img_streamer_reply_entry"))


@pytest.mark.parametrize("name", ["pages-12.img", "p" * 300, "inventory.img"])
def test_requests_and_replies_match_criu_protobuf_messages(name: str) -> None:
    request_entry, reply_entry = criu_messages()
    assert image_stream.parse_request(request_entry(filename=name).SerializeToString()) == name
    for exists in (True, False):
        framed = image_stream.encode_reply(exists=exists)
        (size,) = struct.unpack("=I", framed[:4])
        reply = reply_entry.FromString(framed[4:])
        assert size == len(framed) - 4 and reply.exists is exists
