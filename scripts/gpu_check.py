"""The device check of issue 17, for a machine with an NVIDIA GPU (none on the dev machines).

    python scripts/gpu_check.py [--out DIR] [--device cuda|cpu] [--budget-s 230] [--only ...]
        [--bench-sizes gpt2-small,16e9] [--bench-every 15]

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

- ``bench_state`` (issue 17 item 8): for the 1.49 GB bench state (bench/state_bench.py's
  GPT-2-small with fused Adam, moments filled) and one of at least 16 GB (tensor bytes: fp32
  parameters and two Adam moments), the Checkpointer's stall over the state's bytes / the
  measured pinned device-to-host bandwidth (target <= 1.3).
- ``bench_process`` (item 8): a CUDA process holding that many device bytes under ``cairn run
  --spool``; from its first snapshot, (GPU stall - CRIU frozen) / (bytes / D2H + bytes / H2D),
  both rates measured pinned here (target <= 1.5), with the lock + checkpoint time beside it.
  Its first snapshot must start after the workload filled its memory (``--bench-every``) and
  hold at least its bytes, else the size is failed with the reason.

A phase the machine cannot run (no CUDA, not root, no CRIU, gVisor) is ``skipped`` with the
reason; so is a bench size the GPU, host memory or ``/dev/shm`` cannot hold. A bench phase
writes its JSON after each size, so a phase cut by its time box keeps what it measured. ``--device cpu`` runs ``state``, ``process`` and the benches on the CPU (host memory copies
stand in for the device copies, and the GPU figures are null): a smoke test of this script
where no GPU is lent; ``--bench-sizes`` picks smaller states there. The last line printed is one JSON object:
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
PHASES = ("probe", "state", "process", "remap", "bench_state", "bench_process")
TIME_BOX_S = {"probe": 30, "state": 45, "process": 60, "remap": 60, "bench_state": 75,
              "bench_process": 90}
BENCH_SIZES = "gpt2-small,16e9"  # the 1.49 GB bench state, and one of 16 GB
TARGETS = {"state_stall_vs_d2h": 1.3, "process_stall_vs_copies": 1.5}
COPY_PROBE_BYTES = 2 << 30  # what the pinned bandwidths are measured with

PROC_BENCH = '''
import json, os, sys, time, torch
nbytes, dev, ready = int(sys.argv[1]), torch.device(sys.argv[2]), sys.argv[3]
x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
for part in x.split(1 << 28):
    part.random_(0, 256)  # not zeros: nothing may skip them
if dev.type == "cuda":
    torch.cuda.synchronize()
with open(ready + ".tmp", "w") as f:
    json.dump({"at": time.time(), "bytes": x.numel()}, f)
os.rename(ready + ".tmp", ready)
while True:
    x[:4096].add_(1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    time.sleep(0.05)
'''

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
                           "kernel": platform.release(), "glibc": platform.libc_ver()[1],
                           "host_available_bytes": _host_free(),
                           "criu_env": os.environ.get("CAIRN_CRIU")}
    try:
        st = os.statvfs("/dev/shm")
        out["dev_shm_free_bytes"] = st.f_bavail * st.f_frsize  # the benches' scratch
    except OSError:
        out["dev_shm_free_bytes"] = None
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


# -- item 8: the bench figures -------------------------------------------------------------

def _sizes() -> list[str]:
    return [x.strip() for x in os.environ.get("GPU_CHECK_BENCH_SIZES", BENCH_SIZES).split(",")
            if x.strip()]


def _partial(name: str, result: dict[str, Any]) -> None:
    """Write a bench phase's results so far (the driver keeps them if the time box cuts it)."""
    out = os.environ.get("GPU_CHECK_OUT")
    if out:
        Path(out, f"{name}.json").write_text(json.dumps({**result, "status": "running"},
                                                        indent=2))


def _host_free() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _copy_rates(device: str, nbytes: int = COPY_PROBE_BYTES) -> dict[str, float]:
    """Pinned device-to-host and host-to-device bandwidths, GB/s (median of 3); on the CPU a
    host-to-host copy stands in for both."""
    import torch

    if device != "cuda":
        nbytes = min(nbytes, 256 << 20)
        a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - start)
        rate = nbytes / statistics.median(times) / 1e9
        return {"d2h_gbps": round(rate, 2), "h2d_gbps": round(rate, 2), "bytes": nbytes,
                "what": "host memcpy (no GPU)"}
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = {}
    for name, dst, src in (("d2h_gbps", host, dev_buf), ("h2d_gbps", dev_buf, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rates[name] = round(nbytes / statistics.median(times) / 1e9, 2)
    del dev_buf, host
    torch.cuda.empty_cache()
    return {**rates, "bytes": nbytes, "what": "pinned, cudaMemcpyAsync + synchronize"}


def _size_bytes(size: str) -> int:
    return 1_490_000_000 if size == "gpt2-small" else int(float(size))


def _bench_model(size: str, device: str) -> tuple[Any, Any]:
    """The model and optimizer of a bench state: bench/state_bench.py's GPT-2-small (124.4 M
    parameters) for ``gpt2-small``, else fp32 parameters in 256 MiB tensors with Adam, about SIZE tensor
    bytes with the moments. One step makes the moments; they get non-zero values."""
    import torch

    if size == "gpt2-small":
        # bench/state_bench.py's GPT (FULL), rebuilt here: that module imports torch
        # distributed-checkpoint names the device's torch may not have. The head is tied to
        # the token embedding, so it adds no parameters.
        nn = torch.nn
        model = nn.ModuleList([
            nn.Embedding(50257, 768), nn.Embedding(1024, 768),
            *[nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu",
                                         batch_first=True, norm_first=True)
              for _ in range(12)],
            nn.LayerNorm(768)]).to(device)
        opt = torch.optim.Adam(list(model.parameters()), lr=1e-4)
    else:
        count = _size_bytes(size) // 12  # parameter, exp_avg, exp_avg_sq: 4 bytes each
        chunk = (256 << 20) // 4
        shapes = [chunk] * (count // chunk) + ([count % chunk] if count % chunk else [])
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n, device=device))
                                        for n in shapes])
        opt = torch.optim.Adam(list(model.parameters()), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
            p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        for state in opt.state.values():
            state["exp_avg"].normal_(0.0, 1e-3, generator=gen)
            state["exp_avg_sq"].uniform_(1e-8, 1e-6, generator=gen)
    if device == "cuda":
        torch.cuda.synchronize()
    return model, opt


def _fits(nbytes: int, device: str, *, device_factor: float, host_factor: float) -> str | None:
    """Why a bench of ``nbytes`` cannot run here, or None."""
    import torch

    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if free < nbytes * device_factor:
            return f"the GPU has {free / 1e9:.1f} GB free, {nbytes * device_factor / 1e9:.1f} needed"
    if _host_free() < nbytes * host_factor:
        return (f"{_host_free() / 1e9:.1f} GB of host memory available, "
                f"{nbytes * host_factor / 1e9:.1f} needed")
    return None


def _scratch(nbytes: int) -> str:
    """/dev/shm when it holds ``nbytes`` with room to spare, else /var/tmp."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > nbytes * 1.5:
            return "/dev/shm"
    except OSError:
        pass
    return "/var/tmp"


def phase_bench_state(device: str) -> dict[str, Any]:
    import torch

    from cairn.state import Checkpointer

    if device == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "reason": "torch has no CUDA device"}
    result: dict[str, Any] = {"copy": _copy_rates(device), "sizes": {},
                              "target": TARGETS["state_stall_vs_d2h"]}
    d2h = result["copy"]["d2h_gbps"] * 1e9
    for size in _sizes():
        nbytes = _size_bytes(size)
        # device: parameters, moments and (for the one step) gradients; host: the staging
        # copy in shared memory, the writer's buffers and the store.
        why = _fits(nbytes, device, device_factor=1.45, host_factor=2.5 if device == "cuda"
                    else 3.5)
        if why:
            result["sizes"][size] = {"status": "skipped", "reason": why}
            _partial("bench_state", result)
            continue
        started = time.monotonic()
        model, opt = _bench_model(size, device)
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
            t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0)
        rounds = 3 if state_bytes < 4e9 else 2
        stalls: list[float] = []
        with tempfile.TemporaryDirectory(dir=_scratch(state_bytes)) as root:
            ckpt = Checkpointer(store=f"{root}/store", key=f"gpu/check/bench/{size}",
                                preemption=None)
            try:
                ckpt.restore(model=model, optimizer=opt)
                for n in range(rounds):
                    ckpt.save(n, wait=True)
                    stalls.append(ckpt.last_stall_s or 0.0)
            finally:
                ckpt.close()
        floor = state_bytes / d2h
        stall = statistics.median(stalls[1:])
        entry = {"state_bytes": state_bytes, "stalls_s": [round(x, 4) for x in stalls],
                 "stall_s": round(stall, 6), "d2h_floor_s": round(floor, 6),
                 "stall_vs_d2h": round(stall / floor, 3),
                 "seconds": round(time.monotonic() - started, 1)}
        entry["met"] = entry["stall_vs_d2h"] <= TARGETS["state_stall_vs_d2h"]
        entry["status"] = "passed"
        result["sizes"][size] = entry
        del model, opt
        if device == "cuda":
            torch.cuda.empty_cache()
        _partial("bench_state", result)
    result["status"] = "passed"
    return result


SPOOLED = re.compile(r"snapshot spooled as entry \S+: frozen (\d+) ms \(CRIU\)(?:, GPU stalled "
                     r"(\d+) ms \(lock to unlock; lock (\d+) ms \+ checkpoint (\d+) ms\))?, "
                     r"image ([\d.]+) MB, dump ([\d.]+)s \+ hand-off ([\d.]+)s")


def _process_bench_one(nbytes: int, device: str, rates: dict[str, float],
                       every_s: float) -> dict[str, Any]:
    """One ``cairn run --spool`` of a process holding ``nbytes`` (module docstring)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, \
            tempfile.TemporaryDirectory(dir=_scratch(nbytes)) as spool:
        work = Path(tmp)
        script, ready, log = work / "hold.py", work / "ready.json", work / "run.err"
        script.write_text(PROC_BENCH)
        argv = [sys.executable, "-m", "cairn.cli.main", "run", "--store", str(work / "store"),
                "--key", "gpu/check/bench/process", "--every", f"{every_s:g}s", "--grace",
                "60s", "--workdir", str(work / "cairn"), "--spool", spool, "--",
                sys.executable, str(script), str(nbytes), device, str(ready)]
        with open(log, "wb") as err:
            run = subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=err,
                                   start_new_session=True)
        try:
            seen = None
            deadline = time.monotonic() + every_s + 80
            while time.monotonic() < deadline and run.poll() is None:
                found = SPOOLED.search(log.read_text(errors="replace"))
                if found:
                    seen = (time.time(), found)
                    break
                time.sleep(0.1)
        finally:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        text = log.read_text(errors="replace")
        if seen is None:
            return {"status": "failed", "reason": "no snapshot spooled",
                    "stderr": text[-1500:]}
        at, m = seen
        frozen_ms, stall_ms, lock_ms, ckpt_ms = (float(x) if x else None for x in m.groups()[:4])
        image_mb, dump_s, handoff_s = (float(x) for x in m.groups()[4:])
        held = json.loads(ready.read_text()) if ready.exists() else None
        dump_started = at - dump_s - handoff_s - 0.2  # the log was polled every 0.1 s
        out: dict[str, Any] = {"bytes": nbytes, "frozen_ms": frozen_ms, "gpu_stall_ms": stall_ms,
                               "lock_ms": lock_ms, "checkpoint_ms": ckpt_ms,
                               "lock_plus_checkpoint_ms": (lock_ms + ckpt_ms
                                                           if lock_ms is not None else None),
                               "image_mb": image_mb, "dump_s": dump_s}
        if held is None or held["at"] > dump_started:
            out.update(status="failed", reason="the snapshot started before the workload had "
                       "filled its memory: raise --bench-every")
            return out
        if image_mb * 1e6 < nbytes:
            out.update(status="failed", reason=f"the image ({image_mb:.0f} MB) is smaller than "
                       "the bytes the workload held")
            return out
        copies_s = nbytes / (rates["d2h_gbps"] * 1e9) + nbytes / (rates["h2d_gbps"] * 1e9)
        out["copies_floor_s"] = round(copies_s, 4)
        if device == "cuda":
            if stall_ms is None:
                out.update(status="failed", reason="no GPU stall reported: cairn did not "
                           "checkpoint the GPU")
                return out
            ratio = (stall_ms - frozen_ms) / 1000 / copies_s
            out.update(stall_minus_frozen_vs_copies=round(ratio, 3),
                       checkpoint_vs_d2h=round(ckpt_ms / 1000 / (nbytes / (rates["d2h_gbps"]
                                                                            * 1e9)), 3),
                       met=ratio <= TARGETS["process_stall_vs_copies"])
        else:
            out.update(stall_minus_frozen_vs_copies=None,
                       note="no GPU: CRIU's frozen time only, the figure needs a GPU stall")
        out["status"] = "passed"
        return out


def phase_bench_process(device: str) -> dict[str, Any]:
    why = _why_no_process_mode(device)
    if why:
        return {"status": "skipped", "reason": why}
    rates = _copy_rates(device)
    result: dict[str, Any] = {"copy": rates, "sizes": {},
                              "target": TARGETS["process_stall_vs_copies"]}
    every = float(os.environ.get("GPU_CHECK_BENCH_EVERY", "15"))
    for size in _sizes():
        nbytes = _size_bytes(size)
        # host: the driver's copy in the workload, the image in the spool (tmpfs or disk)
        why = _fits(nbytes, device, device_factor=1.05, host_factor=2.2)
        started = time.monotonic()
        result["sizes"][size] = ({"status": "skipped", "reason": why} if why else
                                 _process_bench_one(nbytes, device, rates, every))
        result["sizes"][size]["seconds"] = round(time.monotonic() - started, 1)
        _partial("bench_process", result)
    result["status"] = ("failed" if any(v["status"] == "failed"
                                        for v in result["sizes"].values()) else "passed")
    return result


RUNNERS = {"probe": phase_probe, "state": phase_state, "process": phase_process,
           "remap": phase_remap, "bench_state": phase_bench_state,
           "bench_process": phase_bench_process}


# -- the driver: each phase in a subprocess, time-boxed, its JSON written as it ends ---------

def run_phase(name: str, device: str, out_dir: Path, time_box: float,
              env: dict[str, str]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, __file__, "--phase", name, "--device", device],
                              capture_output=True, text=True, timeout=time_box,
                              cwd=ROOT, stdin=subprocess.DEVNULL,
                              env={**os.environ, **env, "GPU_CHECK_OUT": str(out_dir)})
        lines = done.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            result = {}
        if not result:
            result = {"status": "failed", "reason": f"exit {done.returncode}",
                      "stderr": done.stderr[-2000:]}
    except subprocess.TimeoutExpired:
        partial = out_dir / f"{name}.json"
        kept = json.loads(partial.read_text()) if partial.exists() else {}
        result = {**kept, "status": "timeout", "reason": f"over its {time_box:.0f}s time box"}
    result["seconds"] = round(time.monotonic() - started, 2)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-s", type=float, default=230.0)
    parser.add_argument("--bench-sizes", default=BENCH_SIZES,
                        help="bench states: gpt2-small (1.49 GB) or a byte count (default "
                             f"{BENCH_SIZES})")
    parser.add_argument("--bench-every", type=float, default=15.0,
                        help="seconds before the process bench's snapshot (the workload must "
                             "have filled its memory by then)")
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
        phases[name] = run_phase(name, args.device, out_dir, min(TIME_BOX_S[name], left),
                                 {"GPU_CHECK_BENCH_SIZES": args.bench_sizes,
                                  "GPU_CHECK_BENCH_EVERY": str(args.bench_every)})
        print(f"{name}: {phases[name]['status']} ({phases[name].get('seconds')}s) "
              f"{phases[name].get('reason') or phases[name].get('note') or ''}", flush=True)
    ok = all(p["status"] in ("passed", "skipped") for p in phases.values())
    summary = {"ok": ok, "device": args.device, "phases": phases}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
