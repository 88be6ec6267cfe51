"""The machine's matrix-multiply peak, measured in the running process.

MFU needs a peak to divide by. A datasheet number is wrong on a shared CPU or a GPU with its own
clocks, so we time square GEMMs (``torch.mm``) in the training dtype on the training device: fp32
on CPU, bf16 on CUDA, with the process's own thread count.
"""

from __future__ import annotations

import time

import torch

#: Square GEMM side per device type: big enough to reach the peak, small enough to take < 0.5 s.
GEMM_SIDE = {"cpu": 1024, "cuda": 8192}


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, repeats: int = 3, side: int | None = None) -> float:
    """Best FLOP/s of ``repeats`` timed ``side × side`` GEMMs (2·side³ FLOPs each) after one
    warm-up, on ``device`` in ``dtype``. The best, not the median: on a loaded machine the peak is
    the least disturbed run."""
    n = side or GEMM_SIDE.get(device.type, 4096)
    gen = torch.Generator(device="cpu").manual_seed(0)  # never touches the training generators
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best
