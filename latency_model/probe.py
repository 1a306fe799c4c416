"""A tiny CPU probe (< 1 s) for the roofline prior: achieved matmul FLOP/s and copy bandwidth.

At the room's edge with :mod:`latency_model.calibration`: it runs code and reads
the clock; the maths in :mod:`latency_model.roofline` takes its numbers as input.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def probe_cpu(threads: int, *, matmul_n: int = 512, copy_mib: int = 64, repeats: int = 5) -> dict[str, Any]:
    """Measure fp32 matmul FLOP/s (torch, ``threads`` intra-op threads) and memory copy bandwidth.

    Best-of-``repeats`` of a ``(n, n) @ (n, n)`` fp32 matmul (``2 n^3`` FLOP) and of a
    ``copy_mib`` MiB numpy copy (read + write: ``2 * bytes`` moved). Restores torch's
    thread count afterwards.

    Returns:
        ``{"peak_flops": FLOP/s, "bandwidth_bytes_s": bytes/s, "threads", "matmul_n", "copy_mib",
        "source": str}``.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(matmul_n, matmul_n, dtype=torch.float32)
        b = torch.randn(matmul_n, matmul_n, dtype=torch.float32)
        torch.mm(a, b)  # warm-up
        best_mm = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best_mm = min(best_mm, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    src = np.ones(copy_mib * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up (page faults)
    best_copy = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_copy = min(best_copy, time.perf_counter() - t0)
    flops = 2 * matmul_n**3 / best_mm
    bandwidth = 2 * src.nbytes / best_copy
    return {"peak_flops": flops, "bandwidth_bytes_s": bandwidth, "threads": threads,
            "matmul_n": matmul_n, "copy_mib": copy_mib,
            "source": f"cpu probe: fp32 {matmul_n}^3 torch.mm on {threads} threads "
                      f"{flops / 1e9:.1f} GFLOP/s; {copy_mib} MiB copy {bandwidth / 1e9:.1f} GB/s"}
