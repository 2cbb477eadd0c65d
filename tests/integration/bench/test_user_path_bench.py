"""``bench/user_path_bench.py --smoke`` runs end to end with real CRIU, the installed ``cairn``
CLI and a fake-gcs-server process: its last line is one JSON object with a row per store, every
side of every row restored a process whose whole buffer gave the digest it gave before the
kill, and it leaves no process and no directory behind. No timing is asserted (the figures are
the bench's business); it drops the page cache, hence ``exclusive``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench_runs import positive
from tests.support.cairn_run import can_run_criu

pytestmark = [
    pytest.mark.exclusive,
    pytest.mark.slow,
    pytest.mark.skipif(not can_run_criu(), reason="needs root and a criu binary (make criu)"),
]

BENCH = Path(__file__).resolve().parents[3] / "bench" / "user_path_bench.py"
STORES = ("local", "gcs", "encrypted")
SIDES = ("plain-eager", "plain-lazy") + tuple(f"{s}-{m}" for s in STORES for m in ("eager", "lazy"))


def _processes_naming(text: str) -> list[str]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        if text in argv:
            found.append(f"{name}: {argv}")
    return found


def test_smoke_restores_every_side_and_verifies_it(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--dir", str(tmp_path)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=600, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    assert summary["cold_cache"] is True  # the default drops the page cache before each side
    assert "criu restore -D DIR -d" in summary["peer"] and "lazy-pages" in summary["peer"]
    assert summary["all_verified"] is True
    assert set(summary["targets"]) == {"eager_vs_plain", "pre_restore_s", "lazy_vs_plain_eager"}
    rows = summary["rows"]
    assert [(r["store"], r["memory"], r["size_bytes"]) for r in rows] == \
        [(s, "random", 32 << 20) for s in STORES]
    for row in rows:
        assert row["verified"] is True, row
        for key in ("plain_eager_s", "plain_lazy_s", "cairn_eager_s", "cairn_lazy_s",
                    "pre_restore_s", "pre_restore_lazy_s", "eager_vs_plain",
                    "lazy_vs_plain_eager", "floor_s"):
            assert positive(row[key]), (key, row)
        assert row["image_bytes"] >= 32 << 20  # the buffer is in the image, and more
        assert row["pre_restore_s"] < row["cairn_eager_s"], row
        assert row["pre_restore_lazy_s"] < row["cairn_lazy_s"], row
        assert set(row["targets_met"]) == set(summary["targets"])
        assert all(isinstance(v, bool) for v in row["targets_met"].values())

    (runs,) = summary["runs"].values()
    assert len(runs) == 1
    for side in SIDES:
        one = runs[0][side]
        assert one["verified"] is True, (side, one)
        assert positive(one["next_step_s"]), (side, one)
        if not side.startswith("plain"):
            assert 0 < one["pre_restore_s"] < one["next_step_s"], (side, one)

    # Nothing left behind: no workload, cairn run, CRIU or fake-gcs-server, no directory.
    assert _processes_naming(str(tmp_path)) == []
    assert list(tmp_path.iterdir()) == []
