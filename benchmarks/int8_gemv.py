"""Decode-row products at the Qwen3.5-9B shapes (GPU), launch by launch as the fused plan runs
them (``engine/fused.py``): the projections that share an input as one group; the down projection
takes ``silu_mul``'s output.

Per group and row count:

- ``bf16``: the bf16 weights through cuBLAS (``F.linear`` per weight, ``silu_mul`` first for down);
- ``bf16_triton``: the same weights through one ``gemv_group`` launch, per launch config;
- ``int8``: ConvRot int8 weights: the rotation launch (``hadamard_rotate``, after ``silu_mul`` for
  down) and one ``gemv_group`` launch, per launch config.

``*`` marks the config ``kernels.gemv._config`` picks. Timed like ``benchmarks/gemv.py``: one graph
chains launches over enough distinct weight copies (>= 256 MB) that nothing is served from L2;
medians of replays; floor = int8 weight bytes (N*K + the scales) / measured copy bandwidth, the
bf16 floor twice that. ``rel_err``: the int8 product against float64 from ComfyUI's own
dequantization input (the rotated x rounded once, int8 times the scale).

Usage: python benchmarks/int8_gemv.py [--rows 1 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.kernels.fused_ops import silu_mul  # noqa: E402
from qwen35_fast.kernels.gemv import _config, gemv_group, hadamard, hadamard_rotate  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from benchmarks.timing import chained_us  # noqa: E402

#: (name, output widths of the group, K, launches per 9B decode step, silu_mul in front)
GROUPS = [("deltanet in (qkv z a b)", [8192, 4096, 32, 32], 4096, 24, False),
          ("deltanet out", [4096], 4096, 24, False),
          ("attn in (q k v)", [8192, 1024, 1024], 4096, 8, False),
          ("attn o", [4096], 4096, 8, False),
          ("mlp gate up", [12288, 12288], 4096, 32, False),
          ("mlp down", [4096], 12288, 32, True),
          ("lm_head", [248320], 4096, 1, False)]
#: (BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [(32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4), (32, 128, 4, 5), (16, 256, 4, 4), (64, 128, 4, 6),
           (128, 128, 8, 4)]
GROUP = 256


def sweep(fn, picked, sets) -> dict:
    """``{config: us}`` for the picked config (key marked ``*``) and ``CONFIGS`` (a config the GPU
    cannot launch, out of shared memory, is left out)."""
    out = {}
    for cfg in [picked] + [c for c in CONFIGS if c != picked]:
        try:
            out[str(cfg) + ("*" if cfg == picked else "")] = chained_us(lambda ws, cfg=cfg: fn(ws, cfg), sets)
        except triton.runtime.errors.OutOfResources:
            torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--json", default="int8_gemv.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    h = hadamard(GROUP, device="cuda", dtype=torch.bfloat16)
    results = []
    for rows in args.rows:
        step = {"floor": 0.0, "bf16": 0.0, "bf16_triton_picked": 0.0, "bf16_triton_best": 0.0, "int8_picked": 0.0,
                "int8_best": 0.0}
        for name, ns, k, uses, glu in GROUPS:
            nbytes = sum(n * k + 4 * n for n in ns)
            copies = max(2, -(-(256 << 20) // nbytes))
            gen = torch.Generator(device="cuda").manual_seed(0)
            sets = [[torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen) for n in ns]
                    for _ in range(copies)]
            scales = [torch.rand(n, device="cuda", generator=gen) * 1e-3 for n in ns]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            u = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)

            def act():
                return silu_mul(x, u) if glu else x

            ref = hadamard_rotate(act(), h).double() @ (sets[0][0].double() * scales[0].double()[:, None]).T
            got = gemv_group(act(), sets[0], scales=scales, convrot=GROUP)[0]
            err = ((got.double() - ref).norm() / ref.norm()).item()
            floor = nbytes / bw * 1e6
            dense = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for n in ns]
                     for _ in range(max(2, copies // 2))]

            def cublas(ws):
                a = act()
                for w in ws:
                    F.linear(a, w)

            row = {"rows": rows, "group": name, "ns": ns, "k": k, "uses": uses, "floor_us": floor, "rel_err": err,
                   "bf16_us": chained_us(cublas, dense),
                   "bf16_triton_us": sweep(lambda ws, cfg: gemv_group(act(), ws, config=cfg),
                                           _config(sum(ns), k), dense)}
            del dense
            row["int8_us"] = sweep(lambda ws, cfg: gemv_group(act(), ws, scales=scales, convrot=GROUP, config=cfg),
                                   _config(sum(ns), k, True), sets)
            del sets
            picks = {}
            for kind in ("bf16_triton", "int8"):
                us = row[f"{kind}_us"]
                picks[kind] = (next(v for key, v in us.items() if key.endswith("*")),
                               min(us.items(), key=lambda kv: kv[1]))
                step[f"{kind}_picked"] += uses * picks[kind][0]
                step[f"{kind}_best"] += uses * picks[kind][1][1]
            step["floor"] += uses * floor
            step["bf16"] += uses * row["bf16_us"]
            results.append(row)
            (tp, tb), (ip, ib) = picks["bf16_triton"], picks["int8"]
            print(f"rows {rows} {name:>24} K {k:<5} floor {floor:6.1f} us | bf16 cuBLAS {row['bf16_us']:6.1f} "
                  f"Triton {tp:6.1f} (best {tb[1]:6.1f} {tb[0]}) | int8 {ip:6.1f} ({100 * floor / ip:3.0f}%) "
                  f"(best {ib[1]:6.1f} {ib[0]}) err {err:.1e}", flush=True)
        print(f"# rows {rows}, one decode step's products (ms): " +
              ", ".join(f"{key} {v / 1e3:.3f}" for key, v in step.items()), flush=True)
        results.append({"rows": rows, "step_ms": {key: v / 1e3 for key, v in step.items()}})
    Path(args.json).write_text(json.dumps({"copy_bw_Bps": bw, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
