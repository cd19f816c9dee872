"""Measured device copy bandwidth: the ceiling every benchmark's floor is computed from."""

from __future__ import annotations

import statistics

import torch


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written (1 GiB of random
    bytes copied 12 times on the current CUDA device, median of the last 10, timed with events)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    times = []
    for _ in range(12):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * n / statistics.median(times[2:])
