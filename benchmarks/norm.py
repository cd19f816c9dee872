"""Speed of the decode step's residual add + RMSNorm (``fused_ops.add_rms_norm``) per launch config (GPU).

At the 9B shape (hidden 4096) a decode step runs 65 of these: the residual is a split-K product's
four float32 partials, and for int8_convrot weights the output is also written ConvRot-rotated
(groups of 256). Each timed graph replays 64 launches over 64 different inputs, chained as the
step chains them (with programmatic dependent launch where the GPU has it); the median of many
replays is reported per launch. ``defer`` rows time the norm that leaves the row's factor to the
product reading it (``kernels/row_norm.py``): each program reads only its own columns.

Usage: python benchmarks/norm.py [--rows 1 4] [--json out.json]
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
from qwen35_fast.kernels.fused_ops import add_rms_norm  # noqa: E402

from benchmarks.timing import graph_replay_us  # noqa: E402

HIDDEN, PARTS, GROUP = 4096, 4, 256
CONFIGS = [(256, 4), (256, 8), (512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 8), (4096, 8), (4096, 16)]


def time_config(rows: int, config, rotate: int, defer: bool = False, n: int = 64, reps: int = 60) -> float:
    """Median microseconds per launch."""
    xs = [torch.randn(1, rows, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    parts = [torch.randn(PARTS, 1, rows, HIDDEN, device="cuda") for _ in range(n)]
    w = torch.rand(HIDDEN, device="cuda") + 0.5

    def launch_all():
        for x, p in zip(xs, parts):
            add_rms_norm(x, p, w, 1e-6, rotate=rotate, config=config, defer=defer)

    return graph_replay_us(launch_all, calls=n, replays=reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--json", default="norm.json")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name(0)}; hidden {HIDDEN}, {PARTS} float32 partials")
    print(f"{'rows':>4} {'rotate':>6} {'defer':>5} {'config':>12} {'us':>7}")
    out = {"hidden": HIDDEN, "parts": PARTS, "rows": []}
    for rows in args.rows:
        for rotate in (GROUP, 0):
            for defer in (False, True):
                for config in [None] + CONFIGS:
                    us = time_config(rows, config, rotate, defer)
                    out["rows"].append({"rows": rows, "rotate": rotate, "defer": defer, "config": config, "us": us})
                    print(f"{rows:>4} {rotate:>6} {str(defer):>5} {str(config or 'current'):>12} {us:>7.2f}",
                          flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
