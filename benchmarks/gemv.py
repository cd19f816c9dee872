"""Decode-row matrix products at the Qwen3.5-9B shapes (GPU): cuBLAS (``F.linear``) against the
Triton ``kernels.gemv`` per launch config, with the per-step total for one decode step.

Each timed graph chains launches over enough distinct weight copies (>= 256 MB) that nothing is
served from L2; medians of replays; the floor is weight bytes / measured copy bandwidth.

Usage: python benchmarks/gemv.py [--rows 1 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.kernels import launch  # noqa: E402
from qwen35_fast.kernels.gemv import gemv  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from benchmarks.timing import chained_us  # noqa: E402

# (name, N, K, uses per decode step of the 9B model)
SHAPES = [("deltanet qkv", 8192, 4096, 24), ("deltanet z / out, attn o", 4096, 4096, 56),
          ("deltanet a / b", 32, 4096, 48), ("mlp gate / up", 12288, 4096, 64), ("mlp down", 4096, 12288, 32),
          ("attn q", 8192, 4096, 8), ("attn k / v", 1024, 4096, 16), ("lm_head", 248320, 4096, 1)]
CONFIGS = [(16, 256, 4, 4), (16, 512, 4, 3), (16, 128, 4, 6), (32, 256, 4, 4), (32, 128, 4, 5), (64, 256, 4, 4),
           (64, 128, 8, 4), (128, 128, 8, 3)]


def timed(fn, weights, x) -> float:
    """Median microseconds per call of fn(x, w) over the weight copies, in one graph."""
    return chained_us(lambda w: fn(x, w), weights)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--json", default="gemv.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}; copy bandwidth {bw / 1e12:.2f} TB/s")
    results = []
    for rows in args.rows:
        step_cublas = step_best = step_tuned = step_floor = 0.0
        for name, n, k, uses in SHAPES:
            nbytes = n * k * 2
            copies = max(2, -(-(256 << 20) // nbytes))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.double(), weights[0].double())
            err = ((gemv(x, weights[0]).double() - ref).norm() / ref.norm()).item()
            floor = nbytes / bw * 1e6
            row = {"rows": rows, "shape": name, "n": n, "k": k, "uses": uses, "floor_us": floor,
                   "cublas_us": timed(F.linear, weights, x), "rel_err": err, "configs": {}}
            for cfg in [None] + CONFIGS:
                key = str(cfg or launch.gemv(n, k, False, 1, "cuda")[0]) + ("*" if cfg is None else "")
                row["configs"][key] = timed(lambda a, w, cfg=cfg: gemv(a, w, config=cfg), weights, x)
            best = min(row["configs"].items(), key=lambda kv: kv[1])
            tuned = next(v for key, v in row["configs"].items() if key.endswith("*"))
            step_cublas += uses * row["cublas_us"]
            step_best += uses * min(best[1], row["cublas_us"])
            step_tuned += uses * tuned
            step_floor += uses * floor
            results.append(row)
            print(f"rows {rows} {name:>24} {n:>6}x{k:<5} floor {floor:7.1f} us  cuBLAS {row['cublas_us']:7.1f} "
                  f"({100 * floor / row['cublas_us']:3.0f}%)  tuned {tuned:7.1f} ({100 * floor / tuned:3.0f}%)  "
                  f"best {best[1]:7.1f} {best[0]} ({100 * floor / best[1]:3.0f}%)  err {err:.1e}", flush=True)
            del weights
        print(f"# rows {rows}, one decode step's products: floor {step_floor / 1e3:.3f} ms, cuBLAS "
              f"{step_cublas / 1e3:.3f} ms, Triton as tuned {step_tuned / 1e3:.3f} ms, best of both "
              f"{step_best / 1e3:.3f} ms", flush=True)
    Path(args.json).write_text(json.dumps({"copy_bw_Bps": bw, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
