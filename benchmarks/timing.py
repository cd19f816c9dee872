"""One CUDA-graph timing helper for every benchmark (beside ``bandwidth.py``, the other shared ruler)."""

from __future__ import annotations

import statistics
import time

import torch


def graph_replay_us(fn, *, calls: int = 1, replays: int = 60, warm: int = 2, warm_replays: int = 5) -> float:
    """Capture ``fn()`` once in a CUDA graph (after ``warm`` eager runs on a side stream, which
    compile kernels and allocate lazily built constants) and return the median microseconds of one
    replay, timed replay by replay with CUDA events, divided by ``calls`` (the calls ``fn`` makes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warm_replays):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3 / calls


def chained_us(fn, items) -> float:
    """Median microseconds of ``fn(item)`` per item, every item's call chained in one captured
    graph (distinct weight copies as the items: nothing is served from L2)."""
    def chain():
        for item in items:
            fn(item)

    return graph_replay_us(chain, calls=len(items))


def back_to_back_ms(fn, *, iters: int = 200) -> float:
    """Median milliseconds of ``fn()`` called ``iters`` times back to back (no host sync between
    calls, CUDA events between them; ``fn`` may replay its own graphs). On the CPU: one timed call."""
    fn()  # compile / capture
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    ev[0].record()
    for i in range(iters):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(iters))[iters // 2]
