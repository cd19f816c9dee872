"""The int8 decode step's weight reads as a chain of pure-read kernels: the floor at launch granularity.

The copy-bandwidth floor (bytes / copy bandwidth) assumes one read of all weights at full speed. The
fused decode step reads them in 129 dependent products, each its own kernel. This benchmark
replays that chain with a kernel that only reads (int8 tiles summed into one value per program, no
activations, no dot), one launch per product with the product's shape and program count, in one
CUDA graph, so the difference to the floor is what the launches alone cost, and the difference
to the GEMV's measured time is what the product itself adds.

Variants (all in one process, interleaved, median over graph replays; each replay reads 7.9 GB, far
more than L2):

- ``plain``: launches as the GEMV without programmatic dependent launch;
- ``pdl``: each kernel waits for its predecessor, then lets the next launch (the GEMV's protocol);
- ``pdl-early``: as ``pdl``, with each program's first weight tile loaded before its wait;
- ``persistent``: as ``pdl``, with one program per SM slot looping over the product's tiles.

Usage: ``python benchmarks/read_chain.py [--size 9b] [--replays 20] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.kernels.pdl import launch_args, trigger, wait  # noqa: E402

BLOCK_N, BLOCK_K, WARPS, STAGES = 32, 256, 4, 4  # the GEMV's int8 pick for most launches


@triton.jit
def _read_kernel(W, OUT, BLOCKS, K_PER, sw, GRID, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EARLY: tl.constexpr, PERSIST: tl.constexpr, PDL: tl.constexpr):
    # Tile b of a [BLOCKS * BLOCK_N, K_PER] int8 matrix: BLOCK_N rows, all K_PER columns.
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    if EARLY:
        acc += tl.load(W + (pid * BLOCK_N + rows)[:, None] * sw + cols[None, :]).to(tl.int32)
    wait(PDL)
    trigger(PDL)
    if PERSIST:
        for b in range(pid, BLOCKS, GRID):
            for k0 in range(0, K_PER, BLOCK_K):
                acc += tl.load(W + (b * BLOCK_N + rows)[:, None] * sw + (k0 + cols)[None, :],
                               eviction_policy="evict_first").to(tl.int32)
    else:
        start = BLOCK_K if EARLY else 0
        for k0 in range(start, K_PER, BLOCK_K):
            acc += tl.load(W + (pid * BLOCK_N + rows)[:, None] * sw + (k0 + cols)[None, :],
                           eviction_policy="evict_first").to(tl.int32)
    tl.store(OUT + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def products(size: str) -> list[tuple[str, int, int, int]]:
    """(name, N, K, split) of each product of one 1-row decode step, in order (9B: 24 DeltaNet and
    8 attention layers, the GEMV's split-K picks)."""
    if size != "9b":
        raise SystemExit("--size: only 9b")
    h, inter, vocab = 4096, 12288, 248320
    out = []
    for i in range(32):
        if i % 4 == 3:
            out.append(("attn in (q k v)", 8192 + 2 * 1024, h, 1))
            out.append(("attn o", h, h, 4))
        else:
            out.append(("deltanet in", 8192 + 4096 + 64, h, 1))
            out.append(("deltanet out", h, h, 4))
        out.append(("mlp gate up", 2 * inter, h, 1))
        out.append(("mlp down", h, inter, 4))
    out.append(("lm_head", vocab, h, 1))
    return out


def launch(w: torch.Tensor, out: torch.Tensor, variant: str, slots: int) -> None:
    """One pure read of ``w`` (int8 ``[N', K']``, N' a multiple of BLOCK_N, K' of BLOCK_K)."""
    blocks = w.shape[0] // BLOCK_N
    persist = variant == "persistent"
    grid = min(blocks, slots) if persist else blocks
    args = launch_args(w.device) if variant != "plain" else {"PDL": False}
    _read_kernel[(grid,)](w, out, blocks, w.shape[1], w.stride(0), grid, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          EARLY=variant == "pdl-early", PERSIST=persist, num_warps=WARPS, num_stages=STAGES,
                          **args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="9b")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=["plain", "pdl", "pdl-early", "persistent"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("read_chain.py needs a CUDA GPU")
    from benchmarks.bandwidth import copy_bandwidth

    dev = torch.device("cuda")
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    plan = products(args.size)
    # Each product's weight as the programs read it: split-K ranges become rows of their own.
    weights = [torch.randint(-127, 128, (n * split, k // split), dtype=torch.int8, device=dev)
               for _name, n, k, split in plan]
    outs = [torch.empty(w.shape[0] // BLOCK_N, dtype=torch.int32, device=dev) for w in weights]
    total = sum(w.numel() for w in weights)
    floor_ms = total / bw * 1e3

    graphs = {}
    for variant in args.variants:
        slots = sms * 3  # the GEMV's occupancy at this config: 3 programs per SM (64 KB of shared memory each)
        for w, o in zip(weights, outs):  # compile outside the capture
            launch(w, o, variant, slots)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for w, o in zip(weights, outs):
                launch(w, o, variant, slots)
        graphs[variant] = g
    times = {v: [] for v in graphs}
    for _ in range(2):  # warm-up
        for g in graphs.values():
            g.replay()
    for _ in range(args.replays):
        for v, g in graphs.items():  # interleaved
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            times[v].append(e0.elapsed_time(e1))
    rows = []
    print(f"{len(plan)} reads, {total / 1e9:.2f} GB, copy bandwidth {bw / 1e12:.2f} TB/s, floor {floor_ms:.3f} ms")
    for v, t in times.items():
        ms = statistics.median(t)
        rows.append({"variant": v, "ms": ms, "floor_pct": 100 * floor_ms / ms, "over_floor_us_per_launch":
                     (ms - floor_ms) * 1e3 / len(plan)})
        print(f"{v:>12}: {ms:.3f} ms ({100 * floor_ms / ms:.0f}% of the floor, "
              f"{(ms - floor_ms) * 1e3 / len(plan):.2f} us over it per launch)")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "copy_bw_Bps": bw,
                                         "launches": len(plan), "bytes": total, "floor_ms": floor_ms,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
