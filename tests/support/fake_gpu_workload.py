"""A workload of the FAKE CUDA driver (native/fakecuda): it loads the fake the way a CUDA
program loads libcuda, registers device memory on the GPUs named in FAKE_GPU_MEMORY
("UUID=BYTES,..."), then counts steps into a metrics file, one line per step. It holds no
real GPU state: what it exercises is cairn's driver calls around CRIU.

    python fake_gpu_workload.py METRICS STEPS [PAUSE]
"""

from __future__ import annotations

import ctypes
import os
import sys

from counter_steps import arguments, count  # run as a script: this folder is on sys.path


def main() -> None:
    args = arguments()
    lib = ctypes.CDLL(os.environ["CAIRN_CUDA_LIBRARY"])
    if lib.fakecudaRegister(os.environ["FAKE_GPU_MEMORY"].encode()) != 0:
        sys.exit("fakecudaRegister failed: is FAKECUDA_STATE_DIR set and the GPU in FAKECUDA_GPUS?")
    count(*args)


if __name__ == "__main__":
    main()
