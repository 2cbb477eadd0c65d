"""DDP and FSDP2 snapshots resume on another number of ranks (issue 35, ADRs 0052 and 0054):
2 -> 1, 1 -> 2 and 2 -> 3 under torchrun (gloo, CPU), FSDP2's pieces uneven. Right after the restore every rank's model, optimizer and
scheduler equal the snapshot's bit for bit; ranks the snapshot had keep their RNGs, an added
rank gets :func:`cairn.state.rng.derived`'s; and the next 20 steps' losses equal, bit for bit,
those of the same M-rank script loading the same snapshot through stock ``dcp.load`` from a
``cairn export --dcp`` copy. ``resize=False`` refuses. A ``StatefulDataLoader`` under a
distributed sampler finishes the interrupted epoch, across resizes, with every index delivered
once but the padding (ADR 0053). A tampered piece of another rank's part skips the snapshot."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cairn.dcp
from cairn import open_store
from cairn.state import rng
from cairn.state.state_io import load_state
from cairn.store import Key
from tests.support import tamper
from tests.support.ddp_resize import rng_digest, state_digest
from tests.support.hang import HANG_S

REPO = Path(__file__).resolve().parents[3]
KEY = "dag/resize/run-1/0"
SNAPSHOT_STEPS, TOTAL = 10, 30  # the snapshot after step 9, then 20 steps


def torchrun(nproc: int, store: Path, *extra: str, total: int = TOTAL) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", "-m", "tests.support.ddp_resize", str(store), KEY,
         "--total", str(total), "--every", "5", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S)


def lines(out: str, what: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(rf"^{what} (\d+) (\S+)$", out, re.M)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """A store holding the snapshot of step 9, taken by 1 and by 2 ranks."""
    stores = {}
    for ranks in (1, 2):
        store = tmp_path_factory.mktemp(f"from-{ranks}") / "store"
        run = torchrun(ranks, store, total=SNAPSHOT_STEPS)
        assert run.returncode == 0, run.stderr[-3000:]
        with open_store(str(store), create=False) as opened:  # close() waited for it
            assert opened.manifest(Key.parse(KEY)).step == SNAPSHOT_STEPS - 1
        stores[ranks] = store
    return stores


@pytest.mark.slow
@pytest.mark.parametrize(("n", "m"), [(2, 1), (1, 2), (2, 3)])
def test_ddp_resumes_resized_as_stock_dcp_would(sources: dict[int, Path], tmp_path: Path,
                                                n: int, m: int) -> None:
    store = tmp_path / "store"
    shutil.copytree(sources[n], store)
    with open_store(str(store), create=False) as opened:
        manifest = opened.manifest(Key.parse(KEY))
        assert manifest.metadata.get("world_size", 1) == n and manifest.step == 9
        parts = [load_state(opened, manifest, prefix=f"rank-{r}/" if n > 1 else "")
                 for r in range(n)]
        cairn.dcp.export(opened, KEY, str(tmp_path / "dcp"))  # rank 0's part: DDP replicas

    resized = torchrun(m, store)
    assert resized.returncode == 0, resized.stderr[-3000:]
    assert re.search(r"^start 10$", resized.stdout, re.M)
    assert f"resizing {n} -> {m} ranks: snapshot seq {manifest.seq} was taken by {n} ranks" \
        in resized.stderr

    # Right after the restore: the state bit for bit, each rank's from its own part or rank 0's.
    restored, rngs = lines(resized.stdout, "restored"), lines(resized.stdout, "rng")
    assert sorted(restored) == sorted(rngs) == list(range(m))
    for rank in range(m):
        part = parts[rank if rank < n else 0]
        assert restored[rank] == state_digest(part["models"]["default"],
                                              part["optimizers"]["default"],
                                              part["schedulers"]["default"]), rank
        if rank < n:
            assert rngs[rank] == rng_digest(part["rng"]["torch"]), rank
        else:
            assert rngs[rank] == rng_digest(rng.derived(parts[0]["rng"], rank=rank)["torch"])
            assert rngs[rank] not in {rng_digest(p["rng"]["torch"]) for p in parts}

    # The next 20 steps: what stock DCP's reader gives the same M-rank script.
    stock = torchrun(m, tmp_path / "unused-store", "--from-dcp", str(tmp_path / "dcp"))
    assert stock.returncode == 0, stock.stderr[-3000:]
    assert re.search(r"^start 10$", stock.stdout, re.M)
    assert lines(stock.stdout, "restored")[0] == restored[0]
    losses = lines(resized.stdout, "loss")
    assert sorted(losses) == list(range(SNAPSHOT_STEPS, TOTAL))
    assert losses == lines(stock.stdout, "loss")

    # The resized run's own snapshots are M-rank snapshots.
    with open_store(str(store), create=False) as opened:
        newest = opened.manifest(Key.parse(KEY))
        assert newest.step == TOTAL - 1 and newest.metadata.get("world_size", 1) == m


@pytest.fixture(scope="module")
def fsdp_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict[int, str]]]:
    """Stores holding the FSDP2 snapshot of step 9, taken by 1 and by 2 ranks, with each
    rank's digest of the whole state at that step."""
    stores = {}
    for ranks in (1, 2):
        store = tmp_path_factory.mktemp(f"fsdp-from-{ranks}") / "store"
        run = torchrun(ranks, store, "--fsdp", total=SNAPSHOT_STEPS)
        assert run.returncode == 0, run.stderr[-3000:]
        stores[ranks] = (store, lines(run.stdout, "final"))
    return stores


@pytest.mark.slow
@pytest.mark.parametrize(("n", "m"), [(2, 1), (1, 2), (2, 3)])
def test_fsdp2_resumes_resharded_as_stock_dcp_would(
        fsdp_sources: dict[int, tuple[Path, dict[int, str]]], tmp_path: Path, n: int,
        m: int) -> None:
    source, final = fsdp_sources[n]
    store = tmp_path / "store"
    shutil.copytree(source, store)
    with open_store(str(store), create=False) as opened:
        manifest = opened.manifest(Key.parse(KEY))
        assert manifest.metadata.get("world_size", 1) == n and manifest.step == 9
        # Each part holds its rank's pieces only (uneven: 16 rows over 2 ranks, 1 row too).
        part = load_state(opened, manifest, prefix="rank-0/" if n > 1 else "")
        weight = part["models"]["default"]["0.weight"]
        assert weight.shape == (16, 8) and tuple(weight.local.shape) == (16 // n, 8)
        cairn.dcp.export(opened, KEY, str(tmp_path / "dcp"))  # the pieces put together

    resized = torchrun(m, store, "--fsdp")
    assert resized.returncode == 0, resized.stderr[-3000:]
    assert re.search(r"^start 10$", resized.stdout, re.M)
    assert f"resizing {n} -> {m} ranks" in resized.stderr
    # Right after the restore every rank's whole model, optimizer and scheduler are the
    # snapshot's, bit for bit, however the pieces were cut.
    restored = lines(resized.stdout, "restored")
    assert sorted(restored) == list(range(m))
    assert set(restored.values()) == set(final.values()) and len(set(final.values())) == 1

    stock = torchrun(m, tmp_path / "unused-store", "--fsdp", "--from-dcp", str(tmp_path / "dcp"))
    assert stock.returncode == 0, stock.stderr[-3000:]
    assert lines(stock.stdout, "restored") == restored
    losses = lines(resized.stdout, "loss")
    assert sorted(losses) == list(range(SNAPSHOT_STEPS, TOTAL))
    assert losses == lines(stock.stdout, "loss")


@pytest.mark.slow
def test_a_tampered_piece_of_another_rank_skips_the_snapshot(
        fsdp_sources: dict[int, tuple[Path, dict[int, str]]], tmp_path: Path) -> None:
    """On one rank, the newest 2-rank snapshot's rank-1 piece of a weight does not verify:
    DCP's read of it is the store's verdict, and the run resumes from the snapshot before."""
    store = tmp_path / "store"
    shutil.copytree(fsdp_sources[2][0], store)
    with open_store(str(store), create=False) as opened:
        manifest = opened.manifest(Key.parse(KEY))
        entry = next(e for e in manifest.files if e.path == "rank-1/tensors/000000")
        chunk = entry.chunks[0]
        tamper.flip_byte(opened.backend, chunk.pack, chunk.offset + chunk.size // 2)
    resumed = torchrun(1, store, "--fsdp")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping snapshot seq {manifest.seq}" in resumed.stderr
    assert re.search(r"^start 5$", resumed.stdout, re.M)


@pytest.mark.slow
def test_resize_false_refuses(sources: dict[int, Path], tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(sources[2], store)
    refused = torchrun(1, store, "--no-resize")
    assert refused.returncode != 0
    assert "taken by 2 ranks and this run has 1, and resize=False refuses to reshard" \
        in refused.stderr


def data_run(nproc: int, store: Path, *, total: int, length: int, sampler: str,
             workers: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", "-m", "tests.support.ddp_data_resize", str(store),
         "data/resize/run-1/0", "--total", str(total), "--every", "5", "--length", str(length),
         "--sampler", sampler, "--workers", str(workers)],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S)


def batches(out: str, *, upto: int | None = None) -> dict[int, list[int]]:
    """Every index each epoch's batches held (steps up to ``upto``, the snapshot's)."""
    seen: dict[int, list[int]] = {}
    for m in re.finditer(r"^batch (\d+) (\d+) (\d+) (\S+)$", out, re.M):
        if upto is None or int(m[2]) <= upto:
            seen.setdefault(int(m[3]), []).extend(int(i) for i in m[4].split(","))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(("worlds", "totals", "length", "sampler", "workers"), [
    ((2, 3, 2), (10, 15, 200), 200, "torch", 0),       # resized again inside the dealt epoch
    ((3, 2), (5, 200), 101, "torchdata", 2),          # the old epoch padded; loader workers
])
def test_the_interrupted_epoch_is_delivered_exactly_once_across_resizes(
        tmp_path: Path, worlds: tuple[int, ...], totals: tuple[int, ...], length: int,
        sampler: str, workers: int) -> None:
    store = tmp_path / "store"
    epoch0: list[int] = []
    start = 0
    for i, (world, total) in enumerate(zip(worlds, totals)):
        run = data_run(world, store, total=total, length=length, sampler=sampler,
                       workers=workers)
        assert run.returncode == 0, run.stderr[-3000:]
        assert re.search(rf"^start {start} 0$", run.stdout, re.M), run.stdout[-2000:]
        if i:
            assert f"resizing {worlds[i - 1]} -> {world} ranks" in run.stderr
        # What a run delivered up to its last snapshot (taken at its last step) counts; the
        # last run runs to its end.
        seen = batches(run.stdout, upto=None if i == len(worlds) - 1 else total - 1)
        epoch0 += seen[0]
        start = total
    # Epoch 0, across the runs: every index, none delivered twice but the padding (the first
    # world's own, then each deal's: at most world - 1 each).
    assert set(epoch0) == set(range(length))
    assert len(epoch0) - length <= sum(w - 1 for w in worlds)
    # The epochs after it: a plain M-rank DistributedSampler's (each index, M's padding).
    m = worlds[-1]
    for epoch in (1, 2):
        assert sorted(set(seen[epoch])) == list(range(length))
        assert len(seen[epoch]) == -(-length // m) * m


@pytest.mark.slow
@pytest.mark.parametrize(("rule", "factor"), [("linear", 0.5), ("sqrt", 0.5 ** 0.5)])
def test_a_learning_rate_rule_scales_the_rates_once_at_the_resize(
        sources: dict[int, Path], tmp_path: Path, rule: str, factor: float) -> None:
    """2 -> 1 ranks: the rates the snapshot had (StepLR halved
    1e-2 at step 7) times the rule's factor, and the scheduler goes on from the scaled base."""
    store = tmp_path / "store"
    shutil.copytree(sources[2], store)
    run = torchrun(1, store, "--resize-lr", rule, total=SNAPSHOT_STEPS + 5)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"learning rates times {factor:.6g} ({rule} rule, 2 -> 1 ranks)" in run.stderr
    assert float.fromhex(lines(run.stdout, "lr")[0]) == 1e-2 * 0.5 * factor
    with open_store(str(store), create=False) as opened:  # the 1-rank snapshot: scaled once
        part = load_state(opened, opened.manifest(Key.parse(KEY)))
    assert part["schedulers"]["default"]["base_lrs"] == [1e-2 * factor]
    assert part["optimizers"]["default"]["param_groups"][0]["lr"] == 1e-2 * 0.25 * factor
