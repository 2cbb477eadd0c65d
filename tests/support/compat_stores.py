"""The compatibility fixture stores: snapshots written by an old cairn, which every later cairn
must still restore (tests/integration/test_old_snapshots.py). Run as a module, as root, with
CRIU, inside ``scripts/isolated.sh`` (the process snapshots hold the workload's PID, which the
restoring test finds free in a PID namespace of its own)::

    scripts/isolated.sh .venv/bin/python -m tests.support.compat_stores tests/fixtures/compat/vN

It writes, under the folder given (which must not exist):

- ``state-plain/``, ``state-sealed/``: a Checkpointer's snapshots of a small model, its Adam
  optimizer and its LR scheduler (steps 1, 3 and 5; inline persists);
- ``process-plain/``, ``process-sealed/``: ``cairn run`` snapshots of the C counter of
  ``native/compat_counter`` (built and run under ``/var/tmp/cairn-compat-vN``, fixed paths: a
  CRIU image names its executable and files by absolute path), killed after two were
  committed;
- ``secret.json``: the secret of the sealed stores (a test secret, of these stores only);
- ``counter.c``: the counter's source as it was built (a restore builds this copy again);
- ``expected.json``: what a restore must give back (tensor digests, the next step, the
  counter's build and arguments), written from the live objects, not read back.

A new fixture is made only when the store's format changes, into a new ``vN``; the old ones
stay, untouched, which is the point.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cairn.state import Checkpointer
from cairn.state.checkpointer import PersistMode

ROOT = Path(__file__).resolve().parents[2]
COUNTER_SOURCE = ROOT / "native" / "compat_counter" / "counter.c"
COUNTER_FLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-static", "-nostdlib",
                 "-fno-pie", "-no-pie", "-fno-ident", "-fno-asynchronous-unwind-tables",
                 "-fno-stack-protector", "-Wl,--build-id=none")
COUNTER_STEPS = 200  # 50 ms each: the restored run counts on for a few seconds, then exits 0
STATE_KEY = "compat/state/run-1"
PROCESS_KEY = "compat/process/run-1"
STATE_STEPS, STATE_EVERY = 6, 2


def build_counter(source: Path, out: Path, flags: list[str]) -> str:
    """Compile the counter to ``out``; returns the binary's sha256."""
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", *flags, "-o", str(out), str(source)], check=True)
    return hashlib.sha256(out.read_bytes()).hexdigest()


def work_folder(fixture: Path) -> Path:
    """Where a fixture's counter ran and every restore of it runs again: its images name
    these paths, so they never change for one fixture."""
    return Path("/var/tmp") / f"cairn-compat-{fixture.name}"


def small_training() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def state_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: Any) -> dict[str, str]:
    """sha256 of every tensor the three hold, and their plain values, by name."""
    out: dict[str, str] = {}
    for name, tensor in model.state_dict().items():
        out[f"model.{name}"] = hashlib.sha256(tensor.detach().numpy().tobytes()).hexdigest()
    for index, slots in optimizer.state_dict()["state"].items():
        for name, value in slots.items():
            out[f"optimizer.{index}.{name}"] = hashlib.sha256(
                value.detach().numpy().tobytes()).hexdigest()
    out["scheduler.last_epoch"] = str(scheduler.state_dict()["last_epoch"])
    out["optimizer.lr"] = repr(optimizer.param_groups[0]["lr"])
    return out


def write_state_store(url: str) -> dict[str, Any]:
    model, optimizer, scheduler = small_training()
    ckpt = Checkpointer(store=url, key=STATE_KEY, every_steps=STATE_EVERY,
                        persist=PersistMode.INLINE)
    assert ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler) == 0
    generator = torch.Generator().manual_seed(3)
    digests: dict[str, str] = {}
    for step in range(STATE_STEPS):
        x = torch.randn(16, 8, generator=generator)
        loss = (model(x) - x[:, :2]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if ckpt.step(step):
            digests = state_digests(model, optimizer, scheduler)
    ckpt.close()  # durable; not finished: the key keeps its snapshots
    return {"key": STATE_KEY, "next_step": STATE_STEPS, "digests": digests}


def write_process_store(url: str, work: Path, variant: str, env: dict[str, str]
                        ) -> dict[str, Any]:
    # The working directory is a track root: the metrics file inside comes back from the
    # snapshot, cut back to its size then.
    base = work / variant
    shutil.rmtree(base, ignore_errors=True)
    cwd, cairn_dir = base / "workspace", base / "cairn"
    cwd.mkdir(parents=True)
    command = [str(work / "counter"), str(cwd / "metrics.txt"), str(COUNTER_STEPS)]
    err = base / "generate.err"
    with open(err, "wb") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "cairn.cli.main", "run", "--store", url, "--key", PROCESS_KEY,
             "--every", "1s", "--workdir", str(cairn_dir), "--", *command],
            cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True, env={**os.environ, **env})
    deadline = time.monotonic() + 120
    while err.read_text(errors="replace").count(" committed") < 2:
        if run.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"cairn run did not commit two snapshots:\n{err.read_text()}")
        time.sleep(0.1)
    os.kill(run.pid, signal.SIGKILL)  # a lost node: no final snapshot
    run.wait()
    if len((cwd / "metrics.txt").read_text().splitlines()) >= COUNTER_STEPS:
        raise SystemExit("the counter finished before it was killed")
    newest = max(int(seq) for seq in re.findall(r"snapshot seq (\d+) committed", err.read_text()))
    shutil.rmtree(base)  # a restore finds only the store (and the counter)
    return {"key": PROCESS_KEY, "command": command, "cwd": str(cwd), "workdir": str(cairn_dir),
            "steps": COUNTER_STEPS, "newest_seq": newest}


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True)  # never over an existing fixture
    secret_file = out / "secret.json"
    from cairn.store.keyring import write_secret_file

    write_secret_file(str(secret_file))
    sealed = {"CAIRN_SECRET_FILE": str(secret_file)}
    work = work_folder(out)
    shutil.copyfile(COUNTER_SOURCE, out / "counter.c")
    expected: dict[str, Any] = {
        "counter_sha256": build_counter(out / "counter.c", work / "counter", list(COUNTER_FLAGS)),
        "counter_flags": list(COUNTER_FLAGS)}
    expected["state-plain"] = write_state_store(str(out / "state-plain"))
    os.environ.update(sealed)
    expected["state-sealed"] = write_state_store(str(out / "state-sealed"))
    del os.environ["CAIRN_SECRET_FILE"]
    expected["process-plain"] = write_process_store(str(out / "process-plain"), work, "plain", {})
    expected["process-sealed"] = write_process_store(str(out / "process-sealed"), work, "sealed",
                                                     sealed)
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
