"""Decode-row products at the Qwen3.5-9B shapes (GPU), launch by launch as the fused plan runs
them (``engine/fused.py``): the projections that share an input as one group.

Per group and row count:

- ``bf16``: the bf16 weights through cuBLAS (``F.linear`` per weight);
- ``bf16_triton``: the same weights through one ``gemv_group`` launch, per launch config;
- ``int8``: ConvRot int8 weights through one ``gemv_group`` launch on x already rotated (the norm,
  SiLU and gate kernels write their output rotated), per launch config; ``rotate_us``: the
  rotation launch the plan still makes for the DeltaNet output (its kernel owns one 128-wide head,
  half a group) and for the ``lm_head`` input;
- ``*_split``: for the single projections whose output feeds a norm (DeltaNet out, attention o,
  MLP down), the picked config with K split in P ranges (float32 partials the norm sums).

``*`` marks what the launch table picks (``kernels/launch.py``). The producers themselves
(norm, SiLU, gate) are not timed here; ``benchmarks/comfy_e2e.py --profile`` lists a whole step.
Timed like ``benchmarks/gemv.py``: one graph chains launches over enough distinct weight copies
(>= 256 MB) that nothing is served from L2; medians of replays; floor = int8 weight bytes (N*K +
the scales) / measured copy bandwidth, the bf16 floor twice that. ``rel_err``: the int8 product
of the rotated x against ``x @ W.T`` in float64, W as comfy-kitchen dequantizes the rows (the
first 4096 output rows).

``--sweep``: int8 only, 1 row: every group under every config of ``SWEEP`` (and the split-K
launches under several K ranges), sorted fastest first. One launch at a time only: a config that
wins here can lose inside the decode step (``benchmarks/CHANGELOG.md`` says which did); check a
change with ``comfy_e2e.py``.

Usage: python benchmarks/int8_gemv.py [--rows 1 4] [--sweep] [--json out.json]
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
from qwen35_fast.kernels import launch  # noqa: E402
from qwen35_fast.kernels.convrot import hadamard  # noqa: E402
from qwen35_fast.kernels.convrot_triton import hadamard_rotate  # noqa: E402
from qwen35_fast.kernels.gemv import gemv_group  # noqa: E402


def _config(n: int, k: int, quant: bool = False, rows: int = 1) -> tuple[int, ...]:
    """The launch table's config for this GPU (``kernels/launch.py``)."""
    return launch.gemv(n, k, quant, rows, "cuda")[0]


def split_k(n: int, k: int, quant: bool = False, rows: int = 1) -> int:
    """The launch table's K ranges for this GPU."""
    return launch.gemv(n, k, quant, rows, "cuda")[1]

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from benchmarks.timing import chained_us  # noqa: E402

#: (name, output widths of the group, K, launches per 9B decode step, feeds a norm, rotation launch)
GROUPS = [("deltanet in (qkv z a b)", [8192, 4096, 32, 32], 4096, 24, False, False),
          ("deltanet out", [4096], 4096, 24, True, True),
          ("attn in (q k v)", [8192, 1024, 1024], 4096, 8, False, False),
          ("attn o", [4096], 4096, 8, True, False),
          ("mlp gate up", [12288, 12288], 4096, 32, False, False),
          ("mlp down", [4096], 12288, 32, True, False),
          ("lm_head", [248320], 4096, 1, False, True)]
#: (BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [(32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4), (32, 128, 4, 5), (16, 256, 4, 4), (64, 128, 4, 6),
           (128, 128, 8, 4), (32, 256, 8, 4), (64, 256, 8, 4), (32, 512, 8, 3), (16, 512, 4, 3)]
SPLITS = [2, 3, 4, 6, 8]
GROUP = 256
#: --sweep: configs (BLOCK_N, BLOCK_K, warps, stages[, K slices]) and, per group, the K ranges
SWEEP = [(32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 4, 5), (32, 128, 4, 6), (32, 256, 4, 2), (32, 256, 4, 3),
         (32, 256, 4, 4), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 2), (64, 256, 4, 3), (64, 256, 4, 4),
         (16, 256, 4, 4), (16, 512, 4, 3), (128, 128, 4, 3),
         # fewer warps read the 16-row x tile from shared memory fewer times; more stages, more bytes in flight
         (32, 128, 2, 5), (32, 256, 2, 4), (64, 128, 2, 5), (64, 256, 2, 4), (32, 256, 1, 4), (32, 256, 4, 6),
         (64, 256, 4, 5), (64, 128, 4, 8), (128, 128, 4, 5), (128, 256, 4, 3),
         # warps own K slices (a fifth value): each reads only its slice of the x tile
         (32, 512, 4, 3, 4), (32, 512, 4, 3, 2), (32, 512, 4, 3), (32, 256, 4, 4, 4), (64, 256, 4, 4, 4),
         (32, 256, 2, 4, 2)]
SWEEP_SPLITS = {"mlp down": (2, 4, 6), "deltanet out": (2, 4), "attn o": (2, 4)}


def int8_sets(ns: list[int], k: int) -> tuple[list, list]:
    """Enough distinct int8 copies of a group's weights (>= 256 MB) that nothing is served from L2,
    and their float32 per-row scales."""
    nbytes = sum(n * k + 4 * n for n in ns)
    copies = max(2, -(-(256 << 20) // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [[torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen) for n in ns]
            for _ in range(copies)]
    return sets, [torch.rand(n, device="cuda", generator=gen) * 1e-3 + 1e-4 for n in ns]


def sweep_int8(bw: float) -> list[dict]:
    """``--sweep``: microseconds per launch of every group at 1 row, per config and K split."""
    rows = []
    for name, ns, k, _, _, _ in GROUPS:
        if name == "lm_head":
            continue
        sets, scales = int8_sets(ns, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        floor = sum(n * k + 4 * n for n in ns) / bw * 1e6
        timed = []
        for cfg in SWEEP:
            for p in SWEEP_SPLITS.get(name, (1,)):
                try:
                    us = chained_us(lambda ws, p=p, cfg=cfg: gemv_group(x, ws, scales=scales, config=cfg, split=p),
                                    sets)
                except triton.runtime.errors.OutOfResources:  # the group's tile loops need more shared memory
                    torch.cuda.synchronize()
                    continue
                timed.append({"config": cfg, "split": p, "us": us})
        del sets
        timed.sort(key=lambda r: r["us"])
        split = split_k(ns[0], k, True) if name in SWEEP_SPLITS else 1
        pick = _config(sum(ns), k, True)
        picked = next((r["us"] for r in timed if tuple(r["config"]) == pick and r["split"] == split), None)
        rows.append({"group": name, "ns": ns, "k": k, "floor_us": floor, "picked": [pick, split, picked],
                     "timed": timed})
        best = timed[0]
        print(f"{name:>24} floor {floor:6.1f} us | picked {pick} split {split}: {picked:6.2f} | best "
              f"{best['config']} split {best['split']}: {best['us']:6.2f} ({100 * floor / best['us']:3.0f}%)",
              flush=True)
    return rows


def sweep(fn, picked, sets, configs=CONFIGS) -> dict:
    """``{config: us}`` for the picked config (key marked ``*``) and ``configs`` (a config the GPU
    cannot launch, out of shared memory, is left out)."""
    out = {}
    for cfg in [picked] + [c for c in configs if c != picked]:
        try:
            out[str(cfg) + ("*" if cfg == picked else "")] = chained_us(lambda ws, cfg=cfg: fn(ws, cfg), sets)
        except triton.runtime.errors.OutOfResources:
            torch.cuda.synchronize()
    return out


def comfy_dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[N, K]``: ComfyUI's dequantization of the ConvRot int8 rows (comfy-kitchen's own)."""
    from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout

    params = TensorWiseINT8Layout.Params(scale=scale.reshape(-1, 1), orig_dtype=torch.float32,
                                         orig_shape=tuple(q.shape), convrot=True, convrot_groupsize=GROUP)
    return QuantizedTensor(q, "TensorWiseINT8Layout", params).dequantize().double()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--sweep", action="store_true", help="int8 at 1 row, every config of SWEEP (see above)")
    ap.add_argument("--json", default="int8_gemv.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if args.sweep:
        Path(args.json).write_text(json.dumps({"copy_bw_Bps": bw, "sweep": sweep_int8(bw)}, indent=1))
        return
    h = hadamard(GROUP, device="cuda", dtype=torch.bfloat16)
    results = []
    for rows in args.rows:
        step = {"floor": 0.0, "bf16": 0.0, "bf16_triton_picked": 0.0, "bf16_triton_best": 0.0, "int8_picked": 0.0,
                "int8_best": 0.0}
        for name, ns, k, uses, into_norm, rotation in GROUPS:
            nbytes = sum(n * k + 4 * n for n in ns)
            sets, scales = int8_sets(ns, k)
            copies = len(sets)
            gen = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            xr = hadamard_rotate(x, h)
            ref = x.double() @ comfy_dequantized(sets[0][0][:4096], scales[0][:4096]).T  # the first 4096 rows
            got = gemv_group(xr, sets[0], scales=scales)[0][:, :4096]
            err = ((got.double() - ref).norm() / ref.norm()).item()
            floor = nbytes / bw * 1e6
            dense = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for n in ns]
                     for _ in range(max(2, copies // 2))]

            def cublas(ws):
                for w in ws:
                    F.linear(x, w)

            row = {"rows": rows, "group": name, "ns": ns, "k": k, "uses": uses, "floor_us": floor, "rel_err": err,
                   "bf16_us": chained_us(cublas, dense),
                   "bf16_triton_us": sweep(lambda ws, cfg: gemv_group(x, ws, config=cfg),
                                           _config(sum(ns), k, False, rows), dense)}
            if into_norm:
                pick = _config(sum(ns), k, False, rows)
                row["bf16_triton_split_us"] = {
                    f"{pick} split {p}" + ("*" if p == split_k(ns[0], k) else ""):
                        chained_us(lambda ws, p=p: gemv_group(x, ws, config=pick, split=p), dense) for p in SPLITS}
            del dense
            row["int8_us"] = sweep(lambda ws, cfg: gemv_group(xr, ws, scales=scales, config=cfg),
                                   _config(sum(ns), k, True, rows), sets)
            if into_norm:
                pick = _config(sum(ns), k, True, rows)
                row["int8_split_us"] = {}
                for cfg in (pick, (32, 256, 8, 4), (64, 256, 4, 4)):
                    for p in SPLITS:
                        key = f"{cfg} split {p}" + ("*" if cfg == pick and p == split_k(ns[0], k, True) else "")
                        row["int8_split_us"][key] = chained_us(
                            lambda ws, p=p, cfg=cfg: gemv_group(xr, ws, scales=scales, config=cfg, split=p), sets)
            row["rotate_us"] = chained_us(lambda _: hadamard_rotate(x, h), range(64)) if rotation else 0.0
            del sets
            picks = {}
            for kind, quant in (("bf16_triton", False), ("int8", True)):
                unsplit, split = row[f"{kind}_us"], row.get(f"{kind}_split_us", {})
                runs = split if into_norm and split_k(ns[0], k, quant) > 1 else unsplit  # what the plan launches
                picked = next(v for key, v in runs.items() if key.endswith("*"))
                picks[kind] = (picked, min({**unsplit, **split}.items(), key=lambda kv: kv[1]))
                extra = row["rotate_us"] if kind == "int8" else 0.0
                step[f"{kind}_picked"] += uses * (picks[kind][0] + extra)
                step[f"{kind}_best"] += uses * (picks[kind][1][1] + extra)
            step["floor"] += uses * floor
            step["bf16"] += uses * row["bf16_us"]
            results.append(row)
            (tp, tb), (ip, ib) = picks["bf16_triton"], picks["int8"]
            print(f"rows {rows} {name:>24} K {k:<5} floor {floor:6.1f} us | bf16 cuBLAS {row['bf16_us']:6.1f} "
                  f"Triton {tp:6.1f} (best {tb[1]:6.1f} {tb[0]}) | int8 {ip:6.1f} ({100 * floor / ip:3.0f}%) "
                  f"(best {ib[1]:6.1f} {ib[0]}) rotate {row['rotate_us']:4.1f} err {err:.1e}", flush=True)
        print(f"# rows {rows}, one decode step's products (ms): " +
              ", ".join(f"{key} {v / 1e3:.3f}" for key, v in step.items()), flush=True)
        results.append({"rows": rows, "step_ms": {key: v / 1e3 for key, v in step.items()}})
    Path(args.json).write_text(json.dumps({"copy_bw_Bps": bw, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
