"""The snapshots page after a step succeeded: a real try SIGKILLed mid-run, a try that resumes
and succeeds, every snapshot record gone (``done``, retention), and the page's data (and
``cairn ls --json``) still show what the killed try did (docs/adr/0031)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

KEY = ("train_dag", "train", "manual__2026-12-02T00:00:00+00:00", "-1")
ROOT = Path(__file__).resolve().parents[3]


def training(store: Path, key: str, *, pace: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.try_training", str(store), key, "--total", "24",
         "--every", "2", "--pace", str(pace)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_the_page_of_a_finished_step_shows_the_killed_try(tmp_path: Path) -> None:
    from cairn.store import Key
    from cairn import open_store
    from cairn_airflow.plugins.page import render_page
    from cairn_airflow.plugins.report import build_report

    store_dir, key = tmp_path / "store", Key(KEY)
    victim = training(store_dir, str(key), pace=0.05)
    assert victim.stdout is not None
    committed = 0
    for line in victim.stdout:
        committed += line.startswith("committed ")
        if committed == 5:  # two more than retention keeps
            victim.send_signal(signal.SIGKILL)
            break
    victim.communicate(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    after = training(store_dir, str(key), pace=0.0)
    out, _ = after.communicate(timeout=180)
    assert after.returncode == 0, out
    start = int(next(line for line in out.splitlines() if line.startswith("start ")).split()[1])

    with open_store(str(store_dir), create=False) as store:
        report = build_report(store, key, outcomes=store.records.outcomes(key))
    assert report.state == "done" and report.snapshots == ()
    killed, succeeded = report.tries
    # Before: "snapshots 0" and "last step –" once retention had removed the records.
    assert (killed.snapshots, killed.last_step) == (start // 2, start - 1)
    assert killed.snapshots >= 5 and killed.bytes_written is not None
    assert killed.outcome is None and killed.ended == f"followed by epoch {succeeded.epoch}"
    assert succeeded.resumed_step == start - 1 and succeeded.steps_saved == start
    assert succeeded.outcome is not None and succeeded.outcome.startswith("succeeded")
    assert succeeded.last_step == 23 and succeeded.stall_s is not None
    # Time saved needs the pace, which the tries measured while their snapshots existed.
    assert report.seconds_per_step is not None and succeeded.seconds_saved is not None

    html = render_page(report, ti={"dag_id": KEY[0], "task_id": KEY[1], "run_id": KEY[2],
                                   "map_index": KEY[3]},
                       api_url="/cairn/api/snapshots?x=1", verify_url="/deep")
    row = html.split(f'<tr class="try-row" data-epoch="{killed.epoch}">', 1)[1].split("</tr>")[0]
    cells = [c.split(">", 1)[1] for c in row.split("</td>")[:-1]]
    assert cells[6:8] == [str(killed.snapshots), str(start - 1)]

    proc = subprocess.run([sys.executable, "-m", "cairn.cli.main", "ls", str(store_dir),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [listed] = json.loads(proc.stdout)
    assert [(t["epoch"], t["snapshots"], t["last_step"]) for t in listed["tries"]] == [
        (killed.epoch, killed.snapshots, killed.last_step),
        (succeeded.epoch, succeeded.snapshots, succeeded.last_step)]
