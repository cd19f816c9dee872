"""Weight-only INT8 decode-row products at the Qwen3.5-9B shapes (GPU): the Triton int8 ``gemv``
per launch config against bf16 cuBLAS and bf16 Triton, plus the ConvRot activation rotation.

Timed like ``benchmarks/gemv.py``: one graph chains launches over enough distinct weight copies
(>= 256 MB) that nothing is served from L2; medians of replays; floor = weight bytes / measured
copy bandwidth (int8: N*K bytes + the scales).

Usage: python benchmarks/int8_gemv.py [--rows 1 4] [--json out.json]
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
from qwen35_fast.kernels.gemv import _config, gemv, hadamard, hadamard_rotate  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from benchmarks.gemv import SHAPES, timed  # noqa: E402

CONFIGS = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4), (64, 512, 8, 3), (32, 128, 4, 6),
           (128, 256, 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--json", default="int8_gemv.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}; copy bandwidth {bw / 1e12:.2f} TB/s")
    results = []
    h = hadamard(256, device="cuda")
    for rows in args.rows:
        step = {"floor": 0.0, "bf16_cublas": 0.0, "int8_tuned": 0.0, "int8_best": 0.0, "rotate": 0.0}
        for name, n, k, uses in SHAPES:
            nbytes = n * k + 4 * n
            copies = max(2, -(-(256 << 20) // nbytes))
            qs = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(copies)]
            scale = torch.rand(n, 1, device="cuda") * 1e-3
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ (qs[0].double() * scale.double()).T
            err = ((gemv(x, qs[0], scale).double() - ref).norm() / ref.norm()).item()
            floor = nbytes / bw * 1e6
            dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
            row = {"rows": rows, "shape": name, "n": n, "k": k, "uses": uses, "floor_us": floor, "rel_err": err,
                   "bf16_cublas_us": timed(F.linear, dense, x), "configs": {}}
            del dense
            row["rotate_us"] = timed(lambda a, w: hadamard_rotate(a, h), qs[:8], x)
            for cfg in [None] + CONFIGS:
                row["configs"][str(cfg or _config(n, k, True)) + ("*" if cfg is None else "")] = timed(
                    lambda a, w, cfg=cfg: gemv(a, w, scale, config=cfg), qs, x)
            best = min(row["configs"].items(), key=lambda kv: kv[1])
            tuned = next(v for key, v in row["configs"].items() if key.endswith("*"))
            step["floor"] += uses * floor
            step["bf16_cublas"] += uses * row["bf16_cublas_us"]
            step["int8_tuned"] += uses * tuned
            step["int8_best"] += uses * best[1]
            step["rotate"] += uses * row["rotate_us"]
            results.append(row)
            print(f"rows {rows} {name:>24} {n:>6}x{k:<5} floor {floor:7.1f} us  "
                  f"bf16 cuBLAS {row['bf16_cublas_us']:7.1f}"
                  f"  int8 tuned {tuned:7.1f} ({100 * floor / tuned:3.0f}%)  best {best[1]:7.1f} {best[0]} "
                  f"({100 * floor / best[1]:3.0f}%)  rotate {row['rotate_us']:5.1f}  err {err:.1e}", flush=True)
            del qs
        print(f"# rows {rows}, one decode step's products (ms): " +
              ", ".join(f"{key} {v / 1e3:.3f}" for key, v in step.items()), flush=True)
        results.append({"rows": rows, "step_ms": {key: v / 1e3 for key, v in step.items()}})
    Path(args.json).write_text(json.dumps({"copy_bw_Bps": bw, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
