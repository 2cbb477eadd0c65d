"""A workload of the FAKE CUDA driver (native/fakecuda) that holds, for real, what a workload
talking to other GPUs or processes holds, then counts steps like fake_gpu_workload.py. It
registers device memory with the fake (FAKE_GPU_MEMORY), then, per MODE:

    peer        starts a child that registers with the fake too (a second CUDA process)
    nccl-shm    creates, maps and unlinks a /dev/shm/nccl-* segment, as NCCL's shm transport
                does
    cuda-ipc    creates and maps a /dev/shm/cuda.shm.* file, as the driver's IPC/MPS does
    infiniband  opens the device FAKE_IB_DEVICE names (a path under /dev/infiniband/)
    mps         connects to the unix socket $CUDA_MPS_PIPE_DIRECTORY/control, which it sets
                itself (from FAKE_MPS_DIR, then exec) where it is not set
    libnccl     maps a file named libnccl.so.2 (FAKE_LIBNCCL) and imports torch.distributed
                where torch is installed: loading NCCL without talking to anyone
    plain       nothing more (MIG and UVM are the fake driver's settings)

    python fake_gpu_sharing_workload.py MODE METRICS STEPS [PAUSE]
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import subprocess
import sys

from counter_steps import count  # run as a script: this folder is on sys.path

HELD: list[object] = []  # kept alive for the workload's life
TAG = os.environ.get("FAKE_SHM_TAG") or str(os.getpid())  # in /dev/shm names: the test removes them


def register() -> None:
    lib = ctypes.CDLL(os.environ["CAIRN_CUDA_LIBRARY"])
    if lib.fakecudaRegister(os.environ["FAKE_GPU_MEMORY"].encode()) != 0:
        sys.exit("fakecudaRegister failed: is FAKECUDA_STATE_DIR set and the GPU in FAKECUDA_GPUS?")


def mapped(path: str, size: int = 1 << 16) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    HELD.append(mmap.mmap(fd, size))
    os.close(fd)  # the mapping stays, as NCCL's does


def main() -> None:
    mode = sys.argv[1]
    metrics, steps = sys.argv[2], int(sys.argv[3])
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
    if mode == "child":
        register()
        print("peer registered", flush=True)
        sys.stdin.read()  # until the parent goes
        return
    if not (mode == "mps" and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ):
        register()
    if mode == "peer":
        child = subprocess.Popen([sys.executable, __file__, "child", metrics, "0"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "peer registered"
        HELD.append(child)
    elif mode == "nccl-shm":
        mapped(f"/dev/shm/nccl-{TAG}")
        os.unlink(f"/dev/shm/nccl-{TAG}")  # NCCL unlinks its segments once both ends map them
    elif mode == "cuda-ipc":
        mapped(f"/dev/shm/cuda.shm.0.{TAG}.1")
    elif mode == "infiniband":
        HELD.append(open(os.environ["FAKE_IB_DEVICE"], "rb", buffering=0))  # noqa: SIM115
    elif mode == "mps":
        if "CUDA_MPS_PIPE_DIRECTORY" not in os.environ:  # set by the workload itself, as a
            os.execve(sys.executable, [sys.executable, *sys.argv],  # launch script would
                      {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": os.environ["FAKE_MPS_DIR"]})
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "control"))
        HELD.append(sock)
    elif mode == "libnccl":
        fd = os.open(os.environ["FAKE_LIBNCCL"], os.O_RDONLY)
        HELD.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        os.close(fd)
        try:
            import torch.distributed  # noqa: F401 - loaded, never initialised
        except ImportError:
            pass
    elif mode != "plain":
        sys.exit(f"unknown mode {mode!r}")
    print(f"holding: {mode}", flush=True)
    count(metrics, steps, pause)


if __name__ == "__main__":
    main()
