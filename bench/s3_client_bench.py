"""S3 client throughput over a slow link, boto3 against obstore: write then read the same
bytes, to choose the client of cairn's S3 store backend by measurement.

Against what: moto's S3 server (``tests/support/s3_server.py``, a real child process) behind
a link proxy (``tests/support/link.py``; ``--rtt-ms`` 30, ``--conn-mib-s`` 16 per connection
and direction) that runs in a child process of its own, so that its event loop does not share
the bench's GIL; it is the tests' ``LinkProxy`` as it is. Every side writes ``--mib`` (512) of
random bytes, then reads them back (each timed) and must get the exact bytes back (SHA-256),
in a fresh bucket emptied afterwards:

* ``boto3-transfer``: ``upload_fileobj`` / ``download_fileobj`` of one object with
  ``TransferConfig(multipart_chunksize=part, max_concurrency=k)`` (``--parts``,
  ``--transfer-k``, and ``max_in_memory_upload_chunks=k``), ``max_pool_connections=k``; a hook
  adds ``IfNoneMatch="*"`` to CompleteMultipartUpload (s3transfer's ExtraArgs does not take it).
* ``boto3-objects``: ``--object-mib`` (32) objects, ``put_object(IfNoneMatch="*")`` and
  ``get_object`` from a ``ThreadPoolExecutor`` of k (``--object-k``), ``max_pool_connections=k``.
* ``obstore-transfer``: ``obstore.put(use_multipart=True, chunk_size=part, max_concurrency=k)``
  of one object (overwrite: obstore makes any put with a ``mode`` a single PUT), then
  ``get_range_async`` of every part, k at a time (asyncio semaphore).
* ``obstore-objects``: ``put_async(mode="create")`` / ``get_async`` of the objects, k at a time.

Ceilings (``raw-http``: http.client threads, presigned URLs, no client library, the objects
shape with the highest k): via the proxy to moto; via a second proxy to a sink HTTP server in
this process (the proxy alone; it must reach 2x the best side); straight to moto (moto
alone). Each side's best configuration (least write + read time) is rerun straight to moto
(``via direct``). Per row: seconds, MB/s (10**6 B/s), ratio to the best side via the proxy in
that direction, the proxy's new connections and requests, and the CPU of the client, moto and
proxy processes in % of one core. The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import io
import itertools
import json
import os
import importlib.util
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from linkenv import (  # noqa: E402  (bench/ is on sys.path)
    CREDS, MiB, ProxyProcess, SinkHandler, SinkServer, boto3_objects, boto3_transfer,
    boto_client, empty_bucket, measure, peak_rss_mib, presigned, raw_http, spans)
from tests.support.s3_server import S3Server  # noqa: E402

SIDES = ("boto3-transfer", "boto3-objects", "obstore-transfer", "obstore-objects")
Side = tuple[Callable[[], Any], Callable[[], Any], Callable[[], Iterable[Any]], Callable[[], Any]]


# -- the sides (boto3's: linkenv.boto3_transfer, linkenv.boto3_objects) -------------------------

def obstore_store(endpoint: str, bucket: str) -> Any:
    from obstore.store import S3Store
    return S3Store(bucket, endpoint=endpoint, virtual_hosted_style_request=False,
                   region=CREDS["AWS_DEFAULT_REGION"], access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
                   secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
                   client_options={"allow_http": True, "timeout": "300s"})


def bounded(k: int, calls: Iterable[Callable[[], Any]]) -> list[Any]:
    """The results of the calls' awaitables, k at a time. Each call is made under the
    semaphore: obstore's ``*_async`` functions start their request when called, not when
    awaited. The main task returns None: on its way out Python 3.11's asyncio.run formats
    repr(main task), result included (signal.getsignal -> enum's ValueError message), which
    costs about 1 s per 32 MiB of bytes."""
    out: list[Any] = []

    async def gather() -> None:
        gate = asyncio.Semaphore(k)

        async def one(call: Callable[[], Any]) -> Any:
            async with gate:
                return await call()
        out.extend(await asyncio.gather(*(one(c) for c in calls)))
    asyncio.run(gather())
    return out


def obstore_transfer(endpoint: str, bucket: str, data: bytes, part: int, k: int) -> Side:
    import obstore
    store, got = obstore_store(endpoint, bucket), []

    def read() -> None:
        got[:] = bounded(k, (lambda s=s, e=e: obstore.get_range_async(store, "blob", start=s, end=e)
                             for s, e in spans(len(data), part)))
    return (lambda: obstore.put(store, "blob", data, use_multipart=True, chunk_size=part,
                                max_concurrency=k), read, lambda: got, lambda: None)


def obstore_objects(endpoint: str, bucket: str, data: bytes, piece: int, k: int) -> Side:
    import obstore
    store, parts, view = obstore_store(endpoint, bucket), spans(len(data), piece), memoryview(data)
    got: list[Any] = []

    async def get(i: int) -> Any:
        return await (await obstore.get_async(store, f"obj-{i:05d}")).bytes_async()

    def read() -> None:
        got[:] = bounded(k, (lambda i=i: get(i) for i in range(len(parts))))

    def write() -> None:
        bounded(k, (lambda i=i, s=s, e=e: obstore.put_async(
            store, f"obj-{i:05d}", view[s:e], mode="create") for i, (s, e) in enumerate(parts)))
    return write, read, lambda: got, lambda: None


def raw_side(url: str, data: bytes, piece: int, k: int, paths: Callable[[str, int], str]
             ) -> Side:
    """The objects shape with http.client and no client library, a connection per thread."""
    where, parts = urllib.parse.urlsplit(url), spans(len(data), piece)
    got: list[Any] = [b""] * len(parts)

    def request(direction: str, i: int) -> tuple[str, str, dict[str, str]]:
        if direction == "write":
            return "PUT", paths("PUT", i), {"If-None-Match": "*"}
        return "GET", paths("GET", i), {}
    write, read = raw_http(where.hostname or "", where.port or 80, memoryview(data), parts, k,
                           request, got=got, ok=(200,))
    return write, read, lambda: got, lambda: None


def create_only_probe(endpoint: str, admin: Any, bucket: str) -> dict[str, str]:
    """Whether moto refuses each library's create-only write of a name the second time."""
    import obstore
    from boto3.s3.transfer import TransferConfig
    admin.create_bucket(Bucket=bucket)
    blob, out = os.urandom(10 * MiB), {}
    client, store = boto_client(endpoint, 4, create_only_mpu=True), obstore_store(endpoint, bucket)
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    writes: dict[str, Callable[[], Any]] = {
        "boto3 put_object IfNoneMatch=*": lambda: client.put_object(
            Bucket=bucket, Key="p1", Body=b"1", IfNoneMatch="*"),
        "boto3 upload_fileobj 10 MiB + IfNoneMatch hook": lambda: client.upload_fileobj(
            io.BytesIO(blob), bucket, "p2", Config=config),
        "obstore put mode=create": lambda: obstore.put(store, "p3", b"1", mode="create"),
        "obstore put 10 MiB mode=create use_multipart=True": lambda: obstore.put(
            store, "p4", blob, mode="create", use_multipart=True, chunk_size=5 * MiB)}
    for (name, write), key in zip(writes.items(), ("p1", "p2", "p3", "p4")):
        write()
        try:
            write()
            out[name] = "second write ACCEPTED: not create-only"
        except Exception as e:  # noqa: BLE001
            out[name] = f"second write refused ({type(e).__name__})"
        tag = admin.head_object(Bucket=bucket, Key=key)["ETag"]
        out[name] += f"; ETag {tag}: {'multipart' if '-' in tag else 'single PUT'}"
    client.close()
    empty_bucket(admin, bucket)
    return out


# -- running ------------------------------------------------------------------------------------

def run_config(cfg: dict[str, Any], env: dict[str, Any], expected: bytes, serial: int
               ) -> dict[str, Any]:
    """Write, read and verify one configuration in a fresh bucket; errors are recorded."""
    via, admin = cfg["via"], env["admin"]
    proxy = env.get(via)  # "proxy" or "sink" (the sink's proxy); None: straight to moto
    pids = {"client": None, **({} if via == "sink" else {"moto": env["moto_pid"]}),
            **({"proxy": proxy.process.pid} if proxy else {})}
    bucket = None if via == "sink" else f"cb-{serial:04d}"
    row: dict[str, Any] = {k: cfg[k] for k in ("side", "config", "via")}
    side: Side | None = None
    try:
        if bucket:
            admin.create_bucket(Bucket=bucket)
        side = cfg["make"](proxy.url if proxy else env["moto_url"], bucket)
        row["write"] = measure(side[0], env["total"], proxy, pids)
        row["read"] = measure(side[1], env["total"], proxy, pids)
        digest = hashlib.sha256()
        for buffer in side[2]():
            digest.update(buffer)
        row["verified"] = digest.digest() == expected
        if not row["verified"]:
            row["error"] = "the bytes read differ from the bytes written"
    except Exception as e:  # noqa: BLE001 - a failing side is reported, the bench goes on
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    finally:
        if side:
            side[3]()
        side = None  # let go of the bytes read before the next side
        gc.collect()
        try:
            if bucket:
                empty_bucket(admin, bucket)
        except Exception as e:  # noqa: BLE001
            row["error"] = row.get("error", "") + f" cleanup: {type(e).__name__}: {e}"[:200]
    print(f"  {row['side']} {row['config']} via {via}: write "
          f"{row.get('write', {}).get('mbps', '-')} read {row.get('read', {}).get('mbps', '-')} "
          f"MB/s {row.get('error', '')}", file=sys.stderr, flush=True)
    return row


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per direction, the run with the median time (the lower middle one), with every time."""
    out: dict[str, Any] = {k: rows[0][k] for k in ("side", "config", "via")}
    for direction in ("write", "read"):
        if done := sorted((r[direction] for r in rows if direction in r),
                          key=lambda d: d["seconds"]):
            out[direction] = {**done[(len(done) - 1) // 2], "runs": [d["seconds"] for d in done]}
    out["verified"] = all(r.get("verified") for r in rows)
    if errors := [r["error"] for r in rows if "error" in r]:
        out["error"] = errors[0]
    return out


def best_of(rows: list[dict[str, Any]], direction: str, prefix: str = "") -> dict[str, Any]:
    ok = [r for r in rows if r["side"] in SIDES and r["side"].startswith(prefix)
          and r["via"] == "proxy" and r["verified"] and direction in r]
    top = max(ok, key=lambda r: r[direction]["mbps"]) if ok else None
    return {"side": top["side"], "config": top["config"], "mbps": top[direction]["mbps"]
            } if top else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes per side, MiB")
    parser.add_argument("--quick", action="store_true", help="64 MiB per side: a smoke run")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--rtt-ms", type=float, default=30.0)
    parser.add_argument("--conn-mib-s", type=float, default=16.0, help="cap per connection")
    parser.add_argument("--parts", default="8,16", help="part sizes of the transfer sides, MiB")
    parser.add_argument("--transfer-k", default="8,16,32", help="their max_concurrency values")
    parser.add_argument("--object-k", default="4,8,16", help="workers of the objects sides")
    parser.add_argument("--object-mib", type=int, default=32)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--no-direct", action="store_true", help="no reruns without the proxy")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("obstore") is None:  # compared here, not a cairn dependency
        print("s3_client_bench: obstore is not installed (it is not a dependency of cairn): "
              "`.venv/bin/pip install obstore`, then run this again", file=sys.stderr)
        return 2
    total, piece = (64 if args.quick else args.mib) * MiB, args.object_mib * MiB
    parts, tks, oks = ([int(x) for x in v.split(",")]
                       for v in (args.parts, args.transfer_k, args.object_k))
    sides, kmax = [s for s in args.sides.split(",") if s], max(tks + oks)
    raw_parts = spans(total, max(MiB, min(piece, total // kmax)))
    rate, rtt = args.conn_mib_s * MiB, args.rtt_ms / 1000
    data = os.urandom(total)
    expected = hashlib.sha256(data).digest()
    SinkHandler.payload = memoryview(data)
    settings = {"total_mib": total // MiB, "runs": args.runs, "rtt_ms": args.rtt_ms,
                "conn_mib_s": args.conn_mib_s, "parts_mib": parts, "transfer_k": tks,
                "object_k": oks, "object_mib": args.object_mib, "cpus": os.cpu_count(),
                "raw_piece_mib": raw_parts[0][1] / MiB, "sides": sides,
                "proxy": "LinkProxy",
                "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"S3 clients over a link: {total // MiB} MiB per side, rtt {args.rtt_ms:g} ms, "
          f"{args.conn_mib_s:g} MiB/s per connection, {settings['proxy']} in its own process, "
          f"{args.runs} run(s), {os.cpu_count()} CPUs, load {settings['loadavg_start']}")
    factories = {"boto3-transfer": boto3_transfer, "obstore-transfer": obstore_transfer,
                 "boto3-objects": boto3_objects, "obstore-objects": obstore_objects}

    def lib(side: str, label: str, size: int, k: int) -> dict[str, Any]:
        return {"side": side, "config": label, "via": "proxy",
                "make": lambda url, bucket: factories[side](url, bucket, data, size, k)}
    proxied = [lib(s, f"part={p}M k={k}", p * MiB, k) for s in sides if s.endswith("transfer")
               for p in parts for k in tks]
    proxied += [lib(s, f"obj={args.object_mib}M k={k}", piece, k) for s in sides
                if s.endswith("objects") for k in oks]
    server, sink = S3Server(), SinkServer(("127.0.0.1", 0), SinkHandler)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    env: dict[str, Any] = {
        "admin": server.client(), "moto_url": server.url, "moto_pid": server._process.pid,
        "total": total, "proxy": ProxyProcess(("127.0.0.1", server.port), rtt, rate),
        "sink": ProxyProcess(("127.0.0.1", sink.server_port), rtt, rate)}

    def raw(url: str, bucket: str | None) -> Side:
        paths = (presigned(env["admin"], bucket, len(raw_parts)) if bucket
                 else lambda method, i: "/%d-%d" % raw_parts[i])
        return raw_side(url, data, raw_parts[0][1], kmax, paths)
    ceilings = [{"side": "raw-http", "config": f"obj={raw_parts[0][1] / MiB:g}M k={kmax}",
                 "via": via, "make": raw} for via in ("sink", "proxy", "direct")]
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    direct: list[dict[str, Any]] = []
    serial = itertools.count()
    try:
        probe = create_only_probe(env["proxy"].url, env["admin"], "cb-probe")
        print("create-only, the same name written twice through the proxy:")
        for name, outcome in probe.items():
            print(f"  {name}: {outcome}")
        for run in range(args.runs):
            for cfg in proxied + ceilings:
                row = run_config(cfg, env, expected, next(serial))
                results.setdefault((cfg["side"], cfg["config"], cfg["via"]), []).append(row)
            if run == 0 and not args.no_direct:
                for side in sides:  # the configuration with the least write + read time
                    done = [(r["write"]["seconds"] + r["read"]["seconds"], c) for c in proxied
                            if c["side"] == side for r in results[(side, c["config"], "proxy")]
                            if "read" in r]
                    if done:
                        direct.append({**min(done, key=lambda d: d[0])[1], "via": "direct"})
            for cfg in direct:
                row = run_config(cfg, env, expected, next(serial))
                results.setdefault((cfg["side"], cfg["config"], cfg["via"]), []).append(row)
        peaks = {"client": peak_rss_mib(None), "moto": peak_rss_mib(env["moto_pid"]),
                 "proxy": peak_rss_mib(env["proxy"].process.pid)}
    finally:
        env["proxy"].stop()
        env["sink"].stop()
        sink.shutdown()
        server.stop()

    rows = [aggregate(r) for r in results.values()]
    best = {d: best_of(rows, d) for d in ("write", "read")}
    print(f"\n{'side':<17}{'config':<15}{'via':<7}{'dir':<6}{'seconds':>8}{'MB/s':>8}{'ratio':>7}"
          f"{'conns':>6}{'reqs':>6}  cpu% client/moto/proxy  ok")
    print("-" * 104)
    for r in rows:
        for direction in ("write", "read"):
            if d := r.get(direction):
                d["ratio"] = round(d["mbps"] / best[direction]["mbps"], 3) if best[direction] else 0
                cpu = "/".join(str(d["cpu_pct"].get(n, "-")) for n in ("client", "moto", "proxy"))
                ok = "ERR" if "error" in r else "yes" if r["verified"] else "NO"
                conns, reqs = ("-" if d[k] is None else d[k] for k in ("connections", "requests"))
                print(f"{r['side']:<17}{r['config']:<15}{r['via']:<7}{direction:<6}"
                      f"{d['seconds']:>8.2f}{d['mbps']:>8.1f}{d['ratio']:>7.3f}{conns:>6}"
                      f"{reqs:>6}  {cpu:<23}{ok}")
    print("(ratio: to the best library side via the proxy in that direction; cpu%: of one core "
          "over the phase; via sink: raw http through the proxy to a sink in the client process)")
    for r in rows:
        if "error" in r:
            print(f"ERROR {r['side']} {r['config']} via {r['via']}: {r['error']}")
    for lib_name in ("boto3", "obstore"):
        for direction in ("write", "read"):
            if top := best_of(rows, direction, lib_name):
                best[f"{lib_name}_{direction}"] = top
                print(f"best {lib_name} {direction}: {top['side']} {top['config']} "
                      f"{top['mbps']:.1f} MB/s")
    ceiling: dict[str, Any] = {"nominal_link_mbps": round(kmax * rate / 1e6, 1), **{
        r["via"]: {d: r[d]["mbps"] for d in ("write", "read") if d in r}
        for r in rows if r["side"] == "raw-http"}}
    verdict = {}
    for direction in ("write", "read"):
        if (link := ceiling.get("sink", {}).get(direction)) is not None and best[direction]:
            verdict[direction] = link >= 2 * best[direction]["mbps"]
            print(f"{direction}: proxy alone {link:.1f} MB/s (raw http k={kmax} to a sink; nominal "
                  f"{ceiling['nominal_link_mbps']}) vs best side {best[direction]['mbps']:.1f}: "
                  f"{'>= 2x, not the bottleneck' if verdict[direction] else '< 2x, MAY LIMIT'}; "
                  f"raw http via proxy to moto {ceiling.get('proxy', {}).get(direction, '-')}, "
                  f"moto alone {ceiling.get('direct', {}).get(direction, '-')} MB/s")
    print("peak RSS MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
    print(json.dumps({"settings": settings, "create_only": probe, "best": best, "ceiling": ceiling,
                      "proxy_not_bottleneck": verdict, "peak_rss_mib": peaks, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
