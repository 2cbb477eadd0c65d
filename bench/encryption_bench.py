"""What encryption costs (issue 18, ADR 0025): an encrypted store against the same store
unencrypted, side by side in one run, and both against the medium's floor.

Sections, each side timed ``--runs`` times (default 5) in rotating order:

* **store**, on the disk (``--dir``, default /var/tmp) and on tmpfs (/dev/shm, where the disk
  does not hide the CPU's cost): ``--size`` (default 1 GiB) of random data written as one
  snapshot (``add_bytes`` + ``commit``, durable on return; 1 MiB chunks), read back with the
  verified streaming read (``iter_file``) and restored with ``store.restore`` (verified,
  fsynced); ``sync`` and a dropped page cache before every side. *plain*: cairn's default store; *sealed*: the
  same with a secret (AES-256-GCM per chunk, keyed BLAKE3 names). The floor: one file written
  in 1 MiB writes + fsync, read back in 1 MiB reads (no hashing, no verification).
* **process image fetch**: a ``--image`` (default 512 MiB) process-like image in 32 KiB page
  chunks, 10% of its pages changed since its parent (so the newest snapshot holds page
  deltas), fetched the way an eager process restore fetches it
  (``SnapshotReader.restore_to(durable=False)``), cold cache, on the disk. This is the store's
  part of a process restore; CRIU's part does not change with encryption.
* **state mode** (real torch): a ``--state`` (default 256 MiB) model + optimizer state;
  ``Checkpointer(persist=PROCESS)`` snapshots (stall: until ``save`` returns, which is what
  training waits for; durable: until ``wait`` returns) and ``Checkpointer.restore`` into a
  fresh model, plain against sealed, on the disk.

* **CPU ceiling**: the same work without I/O on one thread (:func:`cpu_ceiling`): what
  sealed/plain can reach at best on this CPU when nothing else costs.

Targets: sealed/plain throughput of the write and the verified read on tmpfs >= 0.85; the
state-mode stall sealed/plain reported (sealing runs in the writer process, not on the
training thread). The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchenv import drop_caches, fsync_path, loadavg, remove
from cairn.store import Key, Store, StoreSettings
from cairn import open_store
from cairn.store.keyring import new_secret

KEY = Key.parse("bench/encryption/run")
FILE = "data.bin"
TARGETS = {"tmpfs_write_ratio": 0.85, "tmpfs_read_ratio": 0.85}
PAGE = 4096
PIECE = 32 << 10


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def alternate(runs: int, sides: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for run in range(runs):
        shift = run % len(names)
        for name in names[shift:] + names[:shift]:
            out[name].append(sides[name]())
    return out


def timed(fn: Callable[[], Any], *, cold: bool = True) -> float:
    if cold:
        drop_caches()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def floor_write(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for at in range(0, len(data), 1 << 20):
            os.write(fd, data[at:at + (1 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(os.path.dirname(path), directory=True)


def floor_read(path: str) -> None:
    buffer = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


class StoreSide:
    """One store (plain or sealed) under ``root``: fresh for each write, reread after."""

    def __init__(self, root: str, secret: Any, settings: StoreSettings) -> None:
        self.root, self.secret, self.settings = root, secret, settings

    def open(self, *, create: bool = False) -> Store:
        return open_store(self.root, settings=self.settings, secret=self.secret, create=create)

    def write(self, data: memoryview) -> None:
        remove(self.root)
        with self.open(create=True) as store:
            with store.open_attempt(KEY).snapshot() as snap:
                snap.add_bytes(FILE, data)
                snap.commit(step=1)

    def read(self) -> None:
        with self.open() as store:
            reader = store.reader(store.manifest(KEY))
            got = sum(len(piece) for piece in reader.iter_file(FILE))
        assert got > 0

    def restore(self, dest: str) -> None:
        remove(dest)
        with self.open() as store:
            store.restore(KEY, dest)


def store_section(where: str, parent: str, data: memoryview, runs: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="cairn-enc-bench-", dir=parent)
    settings = StoreSettings()
    try:
        sides = {"plain": StoreSide(os.path.join(root, "plain"), None, settings),
                 "sealed": StoreSide(os.path.join(root, "sealed"), new_secret(), settings)}
        floor_path = os.path.join(root, "floor.bin")
        dest = os.path.join(root, "restored")
        size = len(data)
        times: dict[str, dict[str, list[float]]] = {}
        # Each side starts from a synced, dropped page cache, writes included: what an
        # earlier side left dirty is not this side's to write back.
        times["write"] = alternate(runs, {
            "floor": lambda: timed(lambda: floor_write(floor_path, data)),
            **{name: (lambda s=side: timed(lambda: s.write(data))) for name, side in sides.items()}})
        times["read"] = alternate(runs, {
            "floor": lambda: timed(lambda: floor_read(floor_path)),
            **{name: (lambda s=side: timed(s.read)) for name, side in sides.items()}})
        times["restore"] = alternate(runs, {
            name: (lambda s=side: timed(lambda: s.restore(dest))) for name, side in sides.items()})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"medium": where, "size_bytes": size}
    for op, by_side in times.items():
        rates = {side: statistics.median(size / t / 1e6 for t in ts) for side, ts in by_side.items()}
        out[op] = {"mbps": {k: round(v, 1) for k, v in rates.items()},
                   "runs_s": {k: [round(t, 3) for t in ts] for k, ts in by_side.items()},
                   "sealed_vs_plain": round(rates["sealed"] / rates["plain"], 3)}
        if "floor" in rates:
            out[op]["sealed_vs_floor"] = round(rates["sealed"] / rates["floor"], 3)
            out[op]["plain_vs_floor"] = round(rates["plain"] / rates["floor"], 3)
    return out


def image_section(parent: str, image: int, runs: int) -> dict[str, Any]:
    """A process-like image: a parent in 32 KiB page chunks, then 10% of its pages changed
    (page deltas), fetched as an eager restore fetches the newest."""
    rng = random.Random(7)
    base = bytearray(os.urandom(image))
    pages = image // PAGE
    for page in rng.sample(range(pages), pages // 10):
        base[page * PAGE:(page + 1) * PAGE] = os.urandom(PAGE)
    first = os.urandom(image)
    root = tempfile.mkdtemp(prefix="cairn-enc-image-", dir=parent)
    cuts = range(0, image, PIECE)
    locators = list(range(len(cuts)))
    stores = {"plain": None, "sealed": new_secret()}
    try:
        for name, secret in stores.items():
            with open_store(os.path.join(root, name), secret=secret) as store:
                attempt = store.open_attempt(KEY)
                for data in (first, bytes(base)):
                    with attempt.snapshot() as snap:
                        snap.add_bytes("pages-1.img", data, cuts=cuts, locators=locators)
                        snap.commit(step=1)

        def fetch(name: str) -> float:
            dest = os.path.join(root, f"out-{name}")
            remove(dest)
            with open_store(os.path.join(root, name), secret=stores[name], create=False) as store:
                manifest = store.manifest(KEY)
                seconds = timed(lambda: store.reader(manifest).restore_to(dest, durable=False))
            remove(dest)
            return seconds

        times = alternate(runs, {name: (lambda n=name: fetch(n)) for name in stores})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"image_bytes": image, "fetch_s": {k: round(v, 3) for k, v in medians.items()},
            "runs_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
            "sealed_vs_plain_time": round(medians["sealed"] / medians["plain"], 3)}


def state_section(parent: str, state: int, runs: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from cairn import Checkpointer

    width = 1024
    # Adam keeps two moments per parameter: the state is about 3x the parameters.
    layers = max(1, state // 3 // (width * width * 4))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    root = tempfile.mkdtemp(prefix="cairn-enc-state-", dir=parent)
    out: dict[str, Any] = {"state_bytes": 0}
    try:
        results: dict[str, dict[str, list[float]]] = {}
        for name, secret in (("plain", None), ("sealed", new_secret())):
            net = model()
            opt = torch.optim.Adam(net.parameters(), lr=1e-3)
            net(torch.ones(1, width)).sum().backward()
            opt.step()
            path = os.path.join(root, name)
            store = open_store(path, settings=StoreSettings(keep_last=1), secret=secret)
            ckpt = Checkpointer(store=store, key=KEY, every_steps=10**9, preemption=None)
            ckpt.restore(model=net, optimizer=opt)
            r: dict[str, list[float]] = {"stall": [], "durable": [], "restore": []}
            for step in range(1, runs + 2):
                with torch.no_grad():
                    for p in net.parameters():
                        p.add_(1e-3)
                start = time.perf_counter()
                ckpt.save(step)
                staged = time.perf_counter()
                assert ckpt.wait()
                if step > 1:  # the first snapshot also starts the writer process
                    r["stall"].append(staged - start)
                    r["durable"].append(time.perf_counter() - start)
            ckpt.close()
            store.close()
            out["state_bytes"] = sum(p.numel() * 4 for p in net.parameters()) * 3
            for _ in range(runs):
                fresh = model()
                fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
                with open_store(path, settings=StoreSettings(keep_last=1), secret=secret,
                                create=False) as again:
                    again_ckpt = Checkpointer(store=again, key=KEY, every_steps=10**9,
                                              preemption=None)
                    drop_caches()
                    start = time.perf_counter()
                    step = again_ckpt.restore(model=fresh, optimizer=fresh_opt)
                    r["restore"].append(time.perf_counter() - start)
                    assert step == runs + 2, step  # the step after the last one saved
                    again_ckpt.close()
            results[name] = r
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, r in results.items():
        out[name] = {k: round(statistics.median(v), 4) for k, v in r.items()}
        out[name]["runs_s"] = {k: [round(x, 4) for x in v] for k, v in r.items()}
    for figure in ("stall", "durable", "restore"):
        out[f"{figure}_sealed_vs_plain"] = round(out["sealed"][figure] / out["plain"][figure], 3)
    return out


def cpu_ceiling(data: memoryview, runs: int) -> dict[str, Any]:
    """What this CPU allows sealed/plain to reach when it does all the work (tmpfs): one
    thread over ``data`` in the stores' 1 MiB chunks, medians of ``runs``. Read: a copy (what
    the kernel's read from the page cache costs) + BLAKE3 against a copy + AES-256-GCM
    ``decrypt_into`` + keyed BLAKE3; write: BLAKE3 + copy against keyed BLAKE3 +
    ``encrypt_into``. Both stores spread this over the same threads, so the ratio of these
    times is the ceiling of the measured ratios. At most 256 MiB of ``data``."""
    import blake3
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    chunk = 1 << 20
    key, naming = os.urandom(32), os.urandom(32)
    aead, ad = AESGCM(key), b"store-id"
    # At most 256 MiB, sealed ahead into memory of its own: each side reads its bytes from RAM
    # (the same sealed chunk over and over would be read from the CPU's cache).
    pieces = [data[i:i + chunk] for i in range(0, min(len(data), 256 << 20) - chunk + 1, chunk)]
    stored = []
    for n, piece in enumerate(pieces):
        out = bytearray(chunk + 16)
        aead.encrypt_into(n.to_bytes(12, "big"), piece, ad, out)
        stored.append(out)
    plain_buf, sealed_buf = bytearray(chunk), bytearray(chunk + 16)

    def plain_read() -> None:
        for piece in pieces:
            plain_buf[:] = piece
            blake3.blake3(plain_buf).digest()

    def sealed_read() -> None:
        for n, ct in enumerate(stored):
            sealed_buf[:] = ct
            aead.decrypt_into(n.to_bytes(12, "big"), memoryview(sealed_buf), ad, plain_buf)
            blake3.blake3(plain_buf, key=naming).digest()

    def plain_write() -> None:
        for piece in pieces:
            blake3.blake3(piece).digest()
            plain_buf[:] = piece

    def sealed_write() -> None:
        for n, piece in enumerate(pieces):
            blake3.blake3(piece, key=naming).digest()
            aead.encrypt_into(n.to_bytes(12, "big"), piece, ad, sealed_buf)

    times = alternate(runs, {"plain_read": lambda: timed(plain_read, cold=False),
                             "sealed_read": lambda: timed(sealed_read, cold=False),
                             "plain_write": lambda: timed(plain_write, cold=False),
                             "sealed_write": lambda: timed(sealed_write, cold=False)})
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = len(pieces) * chunk
    return {"mbps": {k: round(nbytes / v / 1e6) for k, v in med.items()},
            "read_ceiling": round(med["plain_read"] / med["sealed_read"], 3),
            "write_ceiling": round(med["plain_write"] / med["sealed_write"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=None, help="store data (default 1G)")
    parser.add_argument("--image", type=parse_size, default=None,
                        help="process image (default 512M)")
    parser.add_argument("--state", type=parse_size, default=None,
                        help="torch state (default 256M)")
    parser.add_argument("--runs", type=int, default=None, help="runs per side (default 5)")
    parser.add_argument("--dir", default="/var/tmp", help="the disk's directory")
    parser.add_argument("--tmpfs", default="/dev/shm", help="a tmpfs directory")
    parser.add_argument("--quick", action="store_true", help="a smoke run (the tests run it)")
    args = parser.parse_args(argv)
    size = args.size or (16 << 20 if args.quick else 1 << 30)
    image = args.image or (8 << 20 if args.quick else 512 << 20)
    state = args.state or (16 << 20 if args.quick else 256 << 20)
    runs = args.runs or (2 if args.quick else 5)
    load_start = loadavg()
    cold = drop_caches()
    data = memoryview(os.urandom(size))
    print(f"encryption bench: store {size >> 20} MiB, image {image >> 20} MiB, state "
          f"{state >> 20} MiB, {runs} runs per side; page cache dropped: {cold}", flush=True)
    sections: dict[str, Any] = {}
    sections["disk"] = store_section("disk", args.dir, data, runs)
    sections["tmpfs"] = store_section("tmpfs", args.tmpfs, data, runs)
    sections["cpu"] = cpu_ceiling(data, runs)
    del data
    sections["process_image_fetch"] = image_section(args.dir, image, runs)
    sections["state"] = state_section(args.dir, state, runs)

    print(f"\n{'medium':<7} {'op':<8} {'floor MB/s':>11} {'plain MB/s':>11} {'sealed MB/s':>12} "
          f"{'sealed/plain':>13} {'sealed/floor':>13}")
    for medium in ("disk", "tmpfs"):
        for op in ("write", "read", "restore"):
            row = sections[medium][op]
            floor = row["mbps"].get("floor")
            print(f"{medium:<7} {op:<8} {floor if floor else '-':>11} {row['mbps']['plain']:>11} "
                  f"{row['mbps']['sealed']:>12} {row['sealed_vs_plain']:>13} "
                  f"{row.get('sealed_vs_floor', '-'):>13}")
    cpu = sections["cpu"]
    print(f"CPU ceiling (one thread, 1 MiB chunks, no I/O): read copy+BLAKE3 "
          f"{cpu['mbps']['plain_read']} MB/s, copy+AES-256-GCM+keyed BLAKE3 "
          f"{cpu['mbps']['sealed_read']} MB/s: sealed/plain at most {cpu['read_ceiling']}; "
          f"write {cpu['mbps']['plain_write']} / {cpu['mbps']['sealed_write']} MB/s: at most "
          f"{cpu['write_ceiling']}")
    img = sections["process_image_fetch"]
    print(f"\nprocess image fetch ({image >> 20} MiB, 32 KiB page chunks, deltas; disk, cold): "
          f"plain {img['fetch_s']['plain']} s, sealed {img['fetch_s']['sealed']} s, "
          f"sealed/plain {img['sealed_vs_plain_time']}")
    st = sections["state"]
    print(f"state mode ({st['state_bytes'] >> 20} MiB, disk): stall plain {st['plain']['stall']} s "
          f"sealed {st['sealed']['stall']} s ({st['stall_sealed_vs_plain']}x); durable "
          f"{st['plain']['durable']} / {st['sealed']['durable']} s; restore "
          f"{st['plain']['restore']} / {st['sealed']['restore']} s "
          f"({st['restore_sealed_vs_plain']}x)")
    figures = {"tmpfs_write_ratio": sections["tmpfs"]["write"]["sealed_vs_plain"],
               "tmpfs_read_ratio": sections["tmpfs"]["read"]["sealed_vs_plain"],
               "cpu_read_ceiling": cpu["read_ceiling"], "cpu_write_ceiling": cpu["write_ceiling"]}
    targets = {k: {"value": figures[k], "target": t, "met": figures[k] >= t}
               for k, t in TARGETS.items()}
    print()
    for k, t in targets.items():
        print(f"target {k:<18} {t['value']:>6.3f} >= {t['target']:.2f}  "
              f"{'met' if t['met'] else 'NOT MET'}")
    peers = {"plain": "cairn's default store (no secret): BLAKE3 chunk names, plaintext chunks",
             "sealed": "the same StoreSettings with a secret: AES-256-GCM per chunk extent "
                       "(cryptography, OpenSSL), keyed BLAKE3 names, sealed records",
             "floor": "one file, 1 MiB writes + fsync of it and its directory / 1 MiB reads; no "
                      "hashing or verification"}
    print(json.dumps({**figures, "targets": targets, "peers": peers, "sections": sections,
                      "runs": runs, "cold_cache": cold, "loadavg_start": load_start,
                      "loadavg_end": loadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
