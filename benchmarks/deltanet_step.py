"""Speed of the fused Gated DeltaNet step kernel at the Qwen3.5-9B shape (GPU), per launch config.

Each timed graph replays 48 launches over 48 different states (about 100 MB, twice the L2), as
the 24 DeltaNet layers of two decode steps would; the median of many replays is reported per
launch, with the bytes each launch must move (state read, one state written per row) over the
measured copy bandwidth as the floor.

With ``--rotate 256`` every launch also returns its output ConvRot-rotated, as an int8_convrot
``out_proj`` reads it: whole heads (1 block) pay a ``hadamard_rotate`` launch after the step, split
value columns get it from the gated norm's kernel.

``--configs`` times only those launch configs (``BLOCKS,WARPS`` each; none: the current choice alone).

Usage: python benchmarks/deltanet_step.py [--rows 1 4] [--rotate 256] [--configs 4,4 8,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.kernels.deltanet_step import _config, gated_delta_step  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from benchmarks.timing import graph_replay_us  # noqa: E402

CONFIGS = [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8), (8, 2), (8, 4), (16, 2)]
HK, HV, DK, DV, K = 16, 32, 128, 128, 4


def time_config(rows: int, config, n: int = 48, reps: int = 50, rotate: int = 0) -> float:
    """Median microseconds per launch."""
    dt = torch.bfloat16
    c = 2 * HK * DK + HV * DV
    qkv = torch.randn(1, rows, c, device="cuda", dtype=dt)
    z = torch.randn(1, rows, HV * DV, device="cuda", dtype=dt)
    a = torch.randn(1, rows, HV, device="cuda", dtype=dt)
    b = torch.randn(1, rows, HV, device="cuda", dtype=dt)
    conv = torch.randn(1, c, K - 1, device="cuda", dtype=dt)
    w = torch.randn(c, K, device="cuda", dtype=dt) * 0.5
    neg_a, dt_bias = -torch.rand(HV, device="cuda") * 4, torch.randn(HV, device="cuda") * 0.1
    states = [torch.randn(1, HV, DK, DV, device="cuda") * 0.1 for _ in range(n)]
    outs = [torch.empty(rows, 1, HV, DK, DV, device="cuda") for _ in range(n)]
    nw = torch.ones(DV, device="cuda")

    def launch_all():
        for st, so in zip(states, outs):
            gated_delta_step(qkv, z, a, b, conv, w, neg_a, dt_bias, st, nw, 1e-6, key_heads=HK,
                             states_out=so, config=config, rotate=rotate)

    return graph_replay_us(launch_all, calls=n, replays=reps, warm=1, warm_replays=0)


def _blocks_warps(text: str) -> tuple[int, int]:
    try:
        blocks, warps = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--configs {text!r}: expected BLOCKS,WARPS such as 4,4") from None
    return blocks, warps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--rotate", type=int, default=0, help="ConvRot group of the output (0: none)")
    ap.add_argument("--configs", nargs="*", type=_blocks_warps, default=CONFIGS, metavar="BLOCKS,WARPS",
                    help="launch configs to time besides the current choice (default: a sweep)")
    ap.add_argument("--json", default="deltanet_step.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(0)}; copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'rows':>4} {'blocks':>6} {'warps':>5} {'us':>7} {'floor us':>8} {'floor%':>6}")
    out = {"copy_bw_Bps": bw, "rotate": args.rotate, "rows": []}
    for rows in args.rows:
        floor = (DK * DV * 4 * HV * (1 + rows)) / bw * 1e6
        for config in [None] + args.configs:
            us = time_config(rows, config, rotate=args.rotate)
            cfg = _config(DK, DV, rows, bool(args.rotate)) if config is None else config
            out["rows"].append({"rows": rows, "blocks": cfg[0], "warps": cfg[1], "tuned": config is None,
                                "us": us, "floor_us": floor})
            print(f"{rows:>4} {cfg[0]:>6} {cfg[1]:>5} {us:>7.2f} {floor:>8.2f} {100 * floor / us:>5.0f}%"
                  + ("  (current choice)" if config is None else ""), flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
