"""The 4-bit decode tiles, launch by launch (GPU): the word tile on the FMA units (``gemv4w.py``, this
GPU's current pick) against the tensor-core register tile (``gemv4m.py``) at a few launch configs.

Each GEMV of one Qwen3.5 decode step (``tune.launches``; not ``lm_head`` / ``MTP fc``, which a 4-bit
file keeps as its source holds them) at 1 row (decode) and 4 rows (an MTP-3 verify), weights made by
comfy-kitchen's quantizer (``--formats``: convrot_w4a4, nvfp4), medians of CUDA-graph replays over
weight copies larger than L2 (``timing.chained_us``); the split-K products at the word tile's current
split, and the register tile's also at 1 and 4. Prints a table, writes JSON, and with ``--table`` a
launch table: this GPU's table with each launch where the register tile won by ``--margin`` set to
its fastest setting, for ``comfy_e2e.py --variants`` to time in the whole step.

Usage: python benchmarks/gemv4_tiles.py [--size 9b] [--formats w4a4 nvfp4] [--rows 1 4] [--json gemv4_tiles.json]
       [--table mma.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.kernels import launch  # noqa: E402
from qwen35_fast.kernels.capabilities import device_record  # noqa: E402
from qwen35_fast.kernels.gemv4 import gemv4_group  # noqa: E402

from benchmarks.timing import chained_us  # noqa: E402
from benchmarks.tune import FOUR_BIT, SIZES, _operands, launches  # noqa: E402

#: the register tile's configs timed: (16 rows, 128 * chunks columns, warps, 1 stage, 2)
MMA_CONFIGS = [(16, bk, warps, 1, 2) for bk in (128, 256) for warps in (4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="9b")
    ap.add_argument("--formats", nargs="+", choices=sorted(FOUR_BIT), default=["w4a4"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--margin", type=float, default=0.02, help="what the register tile must win by (0.02 = 2%%)")
    ap.add_argument("--json", default="gemv4_tiles.json")
    ap.add_argument("--table", help="write this GPU's launch table with the register tile's wins here")
    args = ap.parse_args()
    record = device_record("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out, wins = [], {}
    print(f"{torch.cuda.get_device_name()}: word tile (current pick) / register tile, us per launch")
    print("| format | launch | N x K | rows | word tile | register tile (best) | config/split | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, (name, n, k, ns, split_product) in ((f, row) for f in args.formats for row in launches(args.size)):
        if name in ("lm_head", "MTP fc"):
            continue
        make, _ = _operands(kind, ns, k, gen)
        copies = max(2, -(-2 * max(record.l2, 32 << 20) // (n * k // 2)))
        sets = [make() for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(1, rows, k, device="cuda", generator=gen).to(torch.bfloat16)
            picked, split = launch.gemv4(n, k, FOUR_BIT[kind], rows, record, weights=len(ns))
            split = split if split_product else 1

            def run(ws, cfg, p):
                return gemv4_group(x, ws, rotate=False, config=cfg, split=p)
            now = chained_us(lambda ws: run(ws, picked, split), sets)
            splits = sorted({1, 4, split}) if split_product else [1]
            timed = sorted((chained_us(lambda ws, c=c, p=p: run(ws, c, p), sets), c, p)
                           for c in MMA_CONFIGS for p in splits)
            best_us, best, best_split = timed[0]
            rows_out.append({"format": kind, "launch": name, "n": n, "k": k, "rows": rows,
                             "word": [list(picked), split, now], "mma": [[list(c), p, us] for us, c, p in timed]})
            print(f"| {kind} | {name} | {n}x{k} | {rows} | {now:.2f} | {best_us:.2f} | {best}/{best_split} | "
                  f"{now / best_us:.2f}x |", flush=True)
            if best_us < now * (1 - args.margin):
                fields = {"config": list(best)}
                if split_product:
                    fields["split"] = best_split
                wins[f"{kind} {n}x{k} @{rows}"] = fields
        del sets
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size, "rows": rows_out}
    Path(args.json).write_text(json.dumps(out, indent=1))
    if args.table:
        base = launch.table_for(record)
        table = json.loads(Path(base["path"]).read_text()) if base else \
            {"device": record.name, "arch": record.arch, "sms": record.sms, "launches": {}}
        table.setdefault("launches", {}).setdefault("gemv", {}).update(wins)
        table["provenance"] = dict(table.get("provenance", {}), how="gemv4_tiles.py: the register tile's wins")
        Path(args.table).write_text(json.dumps(table, indent=1))
        print(f"{len(wins)} register-tile entries -> {args.table}")


if __name__ == "__main__":
    main()
