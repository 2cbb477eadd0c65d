"""The device check of issue 17, for a machine with an NVIDIA GPU (none on the dev machines).

    python scripts/gpu_check.py [--out DIR] [--device cuda|cpu] [--budget-s 220] [--only ...]

Phases, each in a subprocess with its own time box, each writing ``DIR/<phase>.json`` as it
ends (``DIR``: ``--out``, else ``$OUT``, else ``./gpu-check``):

- ``probe``: what this machine can do (torch and CUDA, the GPUs through NVML, the driver, the
  CUDA checkpoint API, root, CRIU and ``criu check``, gVisor). It reports; it never fails.
- ``state``: state mode with CUDA tensors: a model, Adam, a GradScaler and the CUDA RNG are
  saved and restored into fresh objects; every saved tensor comes back byte for byte, and the
  next steps equal an uninterrupted run's (deterministic algorithms). Also the stall against
  the state's bytes over the measured pinned device-to-host bandwidth.
- ``process``: process mode: a CUDA training loop under ``cairn run``, killed after a snapshot
  and resumed; the resumed run must finish with the losses and weights of an uninterrupted one
  (every step after the restore is a CUDA operation and a synchronize in the restored process).
- ``remap``: the same, resumed with ``CAIRN_GPU_MAP``: onto the other GPU where there are two,
  else an identity map by UUID (the pairs still go to the driver); then only the fake driver
  (``make fakecuda``, tests/integration/process/test_gpu_fake_driver.py) exercised a remap
  to another UUID, and the note says so.

A phase the machine cannot run (no CUDA, not root, no CRIU, gVisor) is ``skipped`` with the
reason. ``--device cpu`` runs ``state`` and ``process`` on the CPU: a smoke test of this
script where no GPU is lent. The last line printed is one JSON object:
``{"ok": ..., "phases": {...}}``; ``ok`` is false when a phase failed or ran out of time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("probe", "state", "process", "remap")
TIME_BOX_S = {"probe": 40, "state": 60, "process": 90, "remap": 90}

TRAIN = '''
import os, sys, time, torch
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
dev = torch.device(sys.argv[4])
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 512)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 512, device=dev)
with open(sys.argv[1], "a") as metrics:
    for step in range(int(sys.argv[2])):
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        metrics.write(f"{step} {loss.item():.10f}\\n"); metrics.flush()
        print(f"step {step}", flush=True)
        time.sleep(float(os.environ.get("GPU_CHECK_PAUSE", "0.03")))
with open(sys.argv[3], "wb") as out:
    for p in model.parameters():
        out.write(p.detach().cpu().numpy().tobytes())
'''


# -- phases (each runs in its own process: python gpu_check.py --phase NAME) -----------------

def phase_probe(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "root": os.geteuid() == 0,
                           "kernel": platform.release()}
    try:
        version = Path("/proc/version").read_text()
    except OSError:
        version = ""
    out["gvisor"] = "gvisor" in version.lower() or Path("/proc/gvisor").exists()
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if out["cuda_available"]:
            out["devices"] = [torch.cuda.get_device_name(i)
                              for i in range(torch.cuda.device_count())]
    except ImportError as e:
        out["torch"] = f"not importable: {e}"
        out["cuda_available"] = False
    from cairn.process import cuda, gpus
    inv = gpus.inventory()
    out["inventory"] = {"source": inv.source.value, "driver": inv.driver,
                        "cuda_driver": inv.cuda_driver, "can_remap": inv.can_remap,
                        "note": inv.note,
                        "gpus": [{"uuid": d.uuid, "name": d.name, "memory_total": d.memory_total,
                                  "memory_used": d.memory_used, "cc": d.compute_capability,
                                  "mig": d.mig} for d in inv.devices]}
    try:
        api = cuda.CudaCheckpoint.load()
        out["checkpoint_api"] = (None if api is None else
                                 {"cuda_version": api.cuda_version, "can_remap": api.can_remap})
    except Exception as e:  # noqa: BLE001 - reported, never fatal here
        out["checkpoint_api"] = f"error: {e}"
    from cairn.process import criu_check, criu_version, find_criu
    try:
        binary = find_criu()
    except Exception as e:  # noqa: BLE001
        binary, out["criu_error"] = None, str(e)
    out["criu"] = binary
    if binary:
        version = criu_version(binary)
        out["criu_version"] = ".".join(map(str, version)) if version else None
        check = criu_check(binary)
        out["criu_check"] = {"ok": check.ok, "tail": check.output.splitlines()[-3:]}
    out["status"] = "passed"
    return out


def _why_no_process_mode(device: str) -> str | None:
    probe = phase_probe(device)
    if not probe["root"]:
        return "not root (process mode needs it)"
    if probe["gvisor"]:
        return "gVisor: CRIU cannot run here"
    if not probe.get("criu"):
        return "no criu binary (CAIRN_CRIU, PATH, /usr/local/sbin)"
    if not probe.get("criu_check", {}).get("ok"):
        return f"criu check fails: {probe.get('criu_check')}"
    if device == "cuda":
        if not probe.get("cuda_available"):
            return "torch has no CUDA device"
        if not isinstance(probe.get("checkpoint_api"), dict):
            return f"no CUDA checkpoint API: {probe.get('checkpoint_api')}"
    return None


def phase_state(device: str) -> dict[str, Any]:
    import torch

    from cairn.state import Checkpointer

    if device == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "reason": "torch has no CUDA device"}
    torch.use_deterministic_algorithms(True)
    dev = torch.device(device)

    def build() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
        return model, opt, scaler

    def step(model: Any, opt: Any, scaler: Any, x: Any) -> float:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return float(loss.item())

    def tensors(model: Any, opt: Any) -> list[bytes]:
        out = [t.detach().cpu().numpy().tobytes() for t in model.state_dict().values()]
        for s in opt.state.values():
            out += [t.detach().cpu().numpy().tobytes() for t in s.values() if torch.is_tensor(t)]
        return out

    def rng() -> bytes:
        state = torch.random.get_rng_state().numpy().tobytes()
        if device == "cuda":
            state += torch.cuda.get_rng_state().numpy().tobytes()
        return state

    model, opt, scaler = build()
    x = torch.randn(32, 1024, device=dev)
    for _ in range(3):
        step(model, opt, scaler, x)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        ckpt = Checkpointer(store=f"{root}/store", key="gpu/check/state/0", preemption=None)
        ckpt.restore(model=model, optimizer=opt, scaler=scaler)
        stalls = []
        for n in range(4):
            ckpt.save(n, wait=True)
            stalls.append(ckpt.last_stall_s or 0.0)
        saved, saved_rng = tensors(model, opt), rng()
        saved_scale = scaler.state_dict()
        ckpt.close()
        reference = [step(model, opt, scaler, x) for _ in range(5)]
        fresh, fresh_opt, fresh_scaler = build()
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(1.0)  # so that a restore that loaded nothing cannot pass
        torch.manual_seed(1234)
        again = Checkpointer(store=f"{root}/store", key="gpu/check/state/0", preemption=None)
        next_step = again.restore(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
        again.close()
        restored, restored_rng = tensors(fresh, fresh_opt), rng()
        resumed = [step(fresh, fresh_opt, fresh_scaler, x) for _ in range(5)]
    state_bytes = sum(len(b) for b in saved)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "state_bytes": state_bytes, "tensors": len(saved), "next_step": next_step,
        "tensors_identical": saved == restored, "rng_identical": saved_rng == restored_rng,
        "scaler_identical": saved_scale == fresh_scaler.state_dict(),
        "later_steps_identical": reference == resumed,
        "median_stall_s": round(statistics.median(stalls[1:]), 4)}
    if device == "cuda":
        gbps = _pinned_d2h_gbps(min(state_bytes, 2 << 30))
        floor = state_bytes / (gbps * 1e9)
        out.update(pinned_d2h_gbps=round(gbps, 2), floor_s=round(floor, 4),
                   stall_vs_d2h_floor=round(out["median_stall_s"] / floor, 2))
    good = all(out[k] for k in ("tensors_identical", "rng_identical", "scaler_identical",
                                "later_steps_identical")) and next_step == 4
    out["status"] = "passed" if good else "failed"
    return out


def _pinned_d2h_gbps(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - start) / 1e9


def _cairn_run(store: str, work: Path, command: list[str], env: dict[str, str],
               log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "cairn.cli.main", "run", "--store", store, "--key",
            "gpu/check/process/0", "--every", "2s", "--grace", "30s", "--workdir",
            str(work / "cairn"), "--", *command]
    with open(log, "wb") as err:
        return subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, env=env,
                                start_new_session=True)


def _resume_check(device: str, gpu_map: str | None) -> dict[str, Any]:
    """Reference run, a cairn run killed after a snapshot, a second one resuming (with
    ``CAIRN_GPU_MAP`` when given). Passed when the second restored and both runs' losses and
    final weights equal the reference's."""
    steps = 150
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        work = Path(tmp)
        script = work / "train.py"
        script.write_text(TRAIN)
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        subprocess.run([sys.executable, str(script), str(work / "ref.txt"), str(steps),
                        str(work / "ref.bin"), device], check=True, env=env, timeout=120,
                       stdout=subprocess.DEVNULL)
        command = [sys.executable, str(script), str(work / "m.txt"), str(steps),
                   str(work / "w.bin"), device]
        store = str(work / "store")
        first = _cairn_run(store, work, command, env, work / "first.err")
        metrics = work / "m.txt"

        def lines() -> int:
            return len(metrics.read_text().splitlines()) if metrics.exists() else 0

        def committed() -> int:
            return len(re.findall(r"snapshot seq \d+ committed", (work / "first.err").read_text()))

        # Kill it mid-training: after a snapshot committed once 20 steps were done.
        deadline, before = time.monotonic() + 60, None
        while time.monotonic() < deadline and first.poll() is None:
            if before is None and lines() >= 20:
                before = committed()
            if before is not None and committed() > before:
                break
            time.sleep(0.2)
        killed_at = lines()
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        first_err = (work / "first.err").read_text()
        if not re.search(r"snapshot seq \d+ committed", first_err):
            return {"status": "failed", "reason": "no snapshot committed within 60 s",
                    "stderr": first_err[-2000:]}
        time.sleep(1.0)  # the killed workload's PIDs must be free for the restore
        env2 = {**env, **({"CAIRN_GPU_MAP": gpu_map} if gpu_map else {})}
        second = _cairn_run(store, work, command, env2, work / "second.err")
        rc = second.wait(timeout=120)
        err = (work / "second.err").read_text()
        got, want = (work / "m.txt").read_text(), (work / "ref.txt").read_text()
        same_weights = (work / "w.bin").exists() and \
            (work / "w.bin").read_bytes() == (work / "ref.bin").read_bytes()
        restored = "restored snapshot seq" in err
        out = {"rc": rc, "restored": restored, "killed_after_steps": killed_at,
               "losses_identical": got == want, "weights_identical": same_weights,
               "gpu_map": gpu_map, "remap_logged": "onto other GPUs" in err,
               "stderr_tail": err.splitlines()[-8:]}
        out["mid_training"] = 0 < killed_at < steps
        out["status"] = "passed" if (rc == 0 and restored and got == want and same_weights
                                     and out["mid_training"]) else "failed"
        return out


def phase_process(device: str) -> dict[str, Any]:
    why = _why_no_process_mode(device)
    if why:
        return {"status": "skipped", "reason": why}
    return _resume_check(device, None)


def phase_remap(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"status": "skipped", "reason": "a GPU remap needs --device cuda"}
    why = _why_no_process_mode(device)
    if why:
        return {"status": "skipped", "reason": why}
    from cairn.process import gpus

    visible = gpus.visible(gpus.inventory().devices)
    if not visible:
        return {"status": "skipped", "reason": "NVML shows no GPU"}
    if len(visible) >= 2 and visible[0].name == visible[1].name:
        # The loop runs on cuda:0; the retry restores it onto the second GPU.
        out = _resume_check(device, f"{visible[0].uuid}={visible[1].uuid}")
        out["note"] = f"remapped {visible[0].uuid} -> {visible[1].uuid}"
    else:
        out = _resume_check(device, f"{visible[0].uuid}={visible[0].uuid}")
        out["note"] = ("one GPU: an identity map by UUID (the pairs were sent to the driver); "
                       "only the fake driver exercised a remap to another UUID")
    return out


RUNNERS = {"probe": phase_probe, "state": phase_state, "process": phase_process,
           "remap": phase_remap}


# -- the driver: each phase in a subprocess, time-boxed, its JSON written as it ends ---------

def run_phase(name: str, device: str, out_dir: Path, time_box: float) -> dict[str, Any]:
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, __file__, "--phase", name, "--device", device],
                              capture_output=True, text=True, timeout=time_box,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
        lines = done.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            result = {}
        if not result:
            result = {"status": "failed", "reason": f"exit {done.returncode}",
                      "stderr": done.stderr[-2000:]}
    except subprocess.TimeoutExpired:
        result = {"status": "timeout", "reason": f"over its {time_box:.0f}s time box"}
    result["seconds"] = round(time.monotonic() - started, 2)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-s", type=float, default=220.0)
    parser.add_argument("--only", nargs="+", choices=PHASES, default=PHASES,
                        help="run only these phases")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:  # a child: run one phase, print its JSON
        print(json.dumps(RUNNERS[args.phase](args.device)))
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    phases: dict[str, Any] = {}
    for name in args.only:
        left = deadline - time.monotonic()
        if left < 10:
            phases[name] = {"status": "skipped", "reason": "the check's budget is spent"}
            continue
        phases[name] = run_phase(name, args.device, out_dir, min(TIME_BOX_S[name], left))
        print(f"{name}: {phases[name]['status']} ({phases[name].get('seconds')}s) "
              f"{phases[name].get('reason') or phases[name].get('note') or ''}", flush=True)
    ok = all(p["status"] in ("passed", "skipped") for p in phases.values())
    summary = {"ok": ok, "device": args.device, "phases": phases}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
