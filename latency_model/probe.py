"""A tiny CPU probe (< 1 s) for the roofline prior: achieved matmul FLOP/s and copy bandwidth.

At the room's edge with :mod:`latency_model.calibration`: it runs code and reads
the clock; the maths in :mod:`latency_model.roofline` takes its numbers as input.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from foundation.compute import on_compute_thread, torch_threads


def _best_matmul_s(torch: Any, threads: int, n: int, repeats: int) -> float:
    with torch_threads(threads):
        a = torch.randn(n, n, dtype=torch.float32)  # (n, n)
        b = torch.randn(n, n, dtype=torch.float32)  # (n, n)
        torch.mm(a, b)  # (n, n) @ (n, n) -> (n, n), 2 n^3 FLOP; warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)  # (n, n) @ (n, n) -> (n, n)
            best = min(best, time.perf_counter() - t0)
        return best


@on_compute_thread
def probe_cpu(threads: int, *, matmul_n: int = 512, copy_mib: int = 64, repeats: int = 15) -> dict[str, Any]:
    """Measure fp32 matmul FLOP/s (torch) and memory copy bandwidth of this CPU.

    Best-of-``repeats`` of a ``(n, n) @ (n, n)`` fp32 matmul (``2 n^3`` FLOP) on
    ``threads`` intra-op threads and on one thread; the peak is the larger of the
    ``threads`` rate and ``threads`` x the one-thread rate, because another busy
    process stalls a multi-threaded GEMM far more than a single thread (the prior
    describes the device, not the moment). Bandwidth: best of a ``copy_mib`` MiB
    numpy copy (read + write: ``2 * bytes`` moved). Restores torch's thread count.

    Returns:
        ``{"peak_flops": FLOP/s, "bandwidth_bytes_s": bytes/s, "threads", "matmul_n", "copy_mib",
        "flops_threads", "flops_one_thread", "source": str}``.
    """
    import torch

    work = 2 * matmul_n**3
    flops_threads = work / _best_matmul_s(torch, threads, matmul_n, repeats)
    flops_one = work / _best_matmul_s(torch, 1, matmul_n, repeats) if threads > 1 else flops_threads
    flops = max(flops_threads, threads * flops_one)
    src = np.ones(copy_mib * (1 << 20) // 8, dtype=np.float64)  # (copy_mib * 2**17,): copy_mib MiB
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up (page faults)
    best_copy = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_copy = min(best_copy, time.perf_counter() - t0)
    bandwidth = 2 * src.nbytes / best_copy
    return {"peak_flops": flops, "bandwidth_bytes_s": bandwidth, "threads": threads,
            "matmul_n": matmul_n, "copy_mib": copy_mib, "flops_threads": flops_threads,
            "flops_one_thread": flops_one,
            "source": f"cpu probe: fp32 {matmul_n}^3 torch.mm {flops_threads / 1e9:.1f} GFLOP/s on "
                      f"{threads} threads, {flops_one / 1e9:.1f} on 1 (peak {flops / 1e9:.1f}); "
                      f"{copy_mib} MiB copy {bandwidth / 1e9:.1f} GB/s"}


def cpu_snapshot() -> tuple[float, float, float] | None:
    """``(all-CPU busy seconds, this process's CPU seconds, perf_counter)`` now, or ``None``.

    Busy time comes from the first line of ``/proc/stat`` (user + nice + system +
    irq + softirq + steal, in USER_HZ ticks); ``None`` where it is unreadable
    (not Linux).
    """
    import os
    import resource

    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    hz = os.sysconf("SC_CLK_TCK")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return ((user + nice + system + irq + softirq + steal) / hz, usage.ru_utime + usage.ru_stime,
            time.perf_counter())


def other_cpu_seconds(start: tuple[float, float, float] | None,
                      end: tuple[float, float, float] | None) -> float | None:
    """CPU-seconds other processes used between two :func:`cpu_snapshot` calls (``None`` if unknown)."""
    if start is None or end is None:
        return None
    return (end[0] - start[0]) - (end[1] - start[1])


def other_cpu_fraction(start: tuple[float, float, float] | None,
                       end: tuple[float, float, float] | None) -> float | None:
    """Share of all cores that *other* processes kept busy between two :func:`cpu_snapshot` calls.

    ``(busy_all - busy_self) / (wall * cores)``, clipped to ``[0, 1]``; ``None``
    when a snapshot is missing. On a 2-core machine with 2 torch threads, a few
    percent already inflates timings (threads wait for a descheduled peer).
    """
    import os

    if start is None or end is None or end[2] <= start[2]:
        return None
    cores = os.cpu_count() or 1
    others = (end[0] - start[0]) - (end[1] - start[1])
    return float(min(1.0, max(0.0, others / ((end[2] - start[2]) * cores))))
