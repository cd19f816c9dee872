"""Tune the decode kernels' launch settings for this GPU and write ``kernels/tuned/<device>.json`` (GPU).

1. **Sweep**: each GEMV launch of a Qwen3.5 decode step (``--size``; the weight formats of
   ``--formats``: int8 and bf16 by default, ``w4a4`` / ``nvfp4`` for 4-bit files (their weights made
   by comfy-kitchen's quantizers); 1 and 4 rows: decode and an MTP-3 verify), timed one launch at a
   time over candidate settings that fit this GPU's shared memory (``kernels/fallback``'s
   estimates), medians of CUDA-graph replays over weight copies larger than L2. The ``--keep``
   fastest are the shortlist.
2. **Confirm in the step** (``--comfyui TREE``): a setting that wins one launch can lose inside the
   whole step. Each shortlisted setting that beat the current pick becomes a one-entry variant
   table, and ``benchmarks/comfy_e2e.py --variants`` times them all in one process, interleaved, on
   the file of its format in ComfyUI (int8 for int8 and bf16 launches; ``--repeat`` times); a
   variant is taken when its median beats the current table's by more than ``--margin``. Without
   ``--comfyui`` the table holds the launch sweep's winners and says so in its provenance.
3. **Write** the table: the current picks for every launch of the step, the taken ones replaced, with
   provenance (GPU, Triton, date, the result files). Send it to us to ship it for your GPU. The
   DeltaNet step, the attention and the L2 prefetch keep their current settings (a table may set
   them by hand: ``kernels/launch.py``).

Usage: python benchmarks/tune.py [--comfyui /path/to/ComfyUI] [--size 9b] [--formats int8 bf16 w4a4 nvfp4]
       [--quick] [--out kernels/tuned]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.kernels import fallback, launch  # noqa: E402
from qwen35_fast.kernels.capabilities import device_record  # noqa: E402

from benchmarks.timing import chained_us  # noqa: E402

#: (hidden, intermediate, DeltaNet key heads, value heads, attention q heads, kv heads, vocab)
SIZES = {"0.8b": (1024, 3584, 16, 16, 8, 2, 248320), "2b": (2048, 6144, 16, 16, 8, 2, 248320),
         "4b": (2560, 9216, 16, 32, 16, 4, 248320), "9b": (4096, 12288, 16, 32, 16, 4, 248320),
         "27b": (5120, 17408, 16, 48, 24, 4, 248320)}
BLOCK_NS, BLOCK_KS, WARPS, STAGES = (32, 64, 128), (128, 256, 512), (2, 4, 8), (2, 3, 4, 5)
#: ``--formats`` name -> the launch tables' kind of its GEMV entries
KINDS = {"int8": "quant", "bf16": "float", "w4a4": "w4a4", "nvfp4": "nvfp4"}
#: table kind -> the 4-bit format name of ``kernels/gemv4.py``
FOUR_BIT = {"w4a4": "convrot_w4a4", "nvfp4": "nvfp4"}
#: table kind -> the file format ``comfy_e2e.py`` confirms its entries on
CONFIRM_ON = {"quant": "int8", "float": "int8", "w4a4": "w4a4", "nvfp4": "nvfp4"}


def launches(size: str) -> list[tuple[str, int, int, list[int], bool]]:
    """(name, N in all, K, the group's weights' rows, split-K product) of every GEMV of one step."""
    h, inter, hk, hv, hq, hkv, vocab = SIZES[size]
    conv = 2 * hk * 128 + hv * 128
    groups = [("DeltaNet inputs", [conv, hv * 128, hv, hv], h, False), ("DeltaNet out_proj", [h], hv * 128, True),
              ("gate/up", [inter, inter], h, False), ("MLP down", [h], inter, True),
              ("attention q/k/v", [2 * hq * 256, hkv * 256, hkv * 256], h, False),
              ("attention o_proj", [h], hq * 256, True), ("lm_head", [vocab], h, False), ("MTP fc", [h], 2 * h, False)]
    return [(name, sum(ns), k, ns, split) for name, ns, k, split in groups]


def candidates(n: int, k: int, quant: bool, weights: int, shared: int, quick: bool) -> list[tuple[int, ...]]:
    """Launch configs to time: the grid, with K slices for 512-wide tiles, that fit ``shared``."""
    out = []
    for bn in BLOCK_NS[:2] if quick else BLOCK_NS:
        for bk in BLOCK_KS:
            for warps in (4,) if quick else WARPS:
                for stages in STAGES:
                    for slices in ((1, 4) if bk == 512 else (1,)):
                        cfg = (bn, bk, warps, stages) + ((slices,) if slices > 1 else ())
                        if bk <= max(16, k) and fallback.gemv_shared(cfg, weights, 1 if quant else 2, 2) <= shared:
                            out.append(cfg)
    return out


def candidates4(k: int, weights: int, shared: int, quick: bool, words: bool = False,
                mma: bool = False) -> list[tuple[int, ...]]:
    """4-bit launch configs to time (BLOCK_K in weight columns). ``words``: the word tile's (one or
    two warps, one stage, lanes on whole words or vector loads: ``gemv4w.py``, both formats at 1..8
    rows), and with ``mma`` the tensor-core register tile's (``gemv4m.py``: 16 rows,
    one or two chunks of 128 columns, 1..8 warps); else the tensor-core tile's, BLOCK_K at most 512
    (wider tiles spill)."""
    out = []
    if words and mma and k % 32 == 0:
        out += [(16, bk, warps, 1, 2) for bk in (128, 256) for warps in ((2, 4, 8) if quick else (1, 2, 4, 8))]
    if words:
        for bn in (8, 16, 32) if quick else (4, 8, 16, 32):
            for bk in (256, 512, 1024):
                for warps in (1,) if quick else (1, 2):
                    for vec in (1,) if quick else (0, 1):
                        if bk <= max(256, k):
                            out.append((bn, bk, warps, 1, vec))
        return out
    for bn in (32, 64) if quick else (16, 32, 64):
        for bk in (128, 256, 512):
            for warps in (4,) if quick else (2, 4, 8):
                for stages in (2, 3, 4):
                    cfg = (bn, bk, warps, stages)
                    if bk <= max(64, k) and fallback.gemv4_shared(cfg, weights, 2) <= shared:
                        out.append(cfg)
    return out


def _operands(kind: str, ns: list[int], k: int, gen):
    """(make one copy of the group's weights, the scales or None) for a table kind."""
    if kind in FOUR_BIT:
        import comfy_kitchen.tensor as ck
        from qwen35_fast.kernels.packed4 import Packed4

        layout = {"w4a4": "TensorCoreConvRotW4A4Layout", "nvfp4": "TensorCoreNVFP4Layout"}[kind]

        def pack(r):
            w = (torch.randn(r, k, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
            extra = {"convrot_groupsize": 256} if kind == "w4a4" else {}
            q = ck.QuantizedTensor.from_float(w, layout, **extra)
            prm = q._params
            return Packed4(FOUR_BIT[kind], q._qdata, prm.scale, getattr(prm, "block_scale", None), r, k,
                           256 if kind == "w4a4" else 0)
        return lambda: [pack(r) for r in ns], None
    if kind == "quant":
        return (lambda: [torch.randint(-127, 128, (r, k), device="cuda", dtype=torch.int8, generator=gen)
                         for r in ns],
                [torch.rand(r, device="cuda", generator=gen) * 1e-3 + 1e-4 for r in ns])
    return lambda: [torch.randn(r, k, device="cuda", generator=gen).to(torch.bfloat16) for r in ns], None


def sweep_gemv(size: str, kind: str, rows: int, keep: int, quick: bool, record, only=None) -> list[dict]:
    """Per launch: the current pick's time and the ``keep`` fastest (config, split) with theirs;
    ``kind`` a table kind (``KINDS``' values); ``only``: launch names to sweep (None: all)."""
    from qwen35_fast.kernels.gemv import gemv_group
    from qwen35_fast.kernels.gemv4 import gemv4_group
    from triton.runtime.errors import OutOfResources

    gen = torch.Generator(device="cuda").manual_seed(0)
    quant, out = kind != "float", []
    for name, n, k, ns, split in launches(size):
        if only is not None and name not in only:
            continue
        if name == "lm_head" and quick or kind in FOUR_BIT and name in ("lm_head", "MTP fc"):
            continue  # a 4-bit file keeps lm_head and mtp.* as its source holds them
        nbytes = sum(r * k for r in ns) * {"float": 2, "quant": 1}.get(kind, 0.5)
        copies = max(2, -(-2 * max(record.l2, 32 << 20) // int(nbytes)))
        make, scales = _operands(kind, ns, k, gen)
        sets = [make() for _ in range(copies)]
        x = torch.randn(1, rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        if kind in FOUR_BIT:
            picked, picked_split = launch.gemv4(n, k, FOUR_BIT[kind], rows, record, weights=len(ns))
            words = launch.gemv4_words(FOUR_BIT[kind], k, rows)
            grid = candidates4(k, len(ns), record.shared, quick, words, mma=True)

            def run(ws, cfg, p):
                return gemv4_group(x, ws, rotate=False, config=cfg, split=p)
        else:
            picked, picked_split = launch.gemv(n, k, quant, rows, record, weights=len(ns))
            grid = candidates(n, k, quant, len(ns), record.shared, quick)

            def run(ws, cfg, p):
                return gemv_group(x, ws, scales=scales, config=cfg, split=p)
        splits = ((4, 8, 16) if quick else (1, 2, 4, 8, 16)) if kind in FOUR_BIT and words and split else \
            (1, 2, 4, 8) if split else (1,)
        timed = []
        for cfg in [picked] + [c for c in grid if c != picked]:
            for p in splits:
                try:
                    us = chained_us(lambda ws, cfg=cfg, p=p: run(ws, cfg, p), sets)
                except OutOfResources:
                    torch.cuda.synchronize()
                    continue
                timed.append({"config": list(cfg), "split": p, "us": us})
        del sets
        timed.sort(key=lambda r: r["us"])
        now = next((r["us"] for r in timed if tuple(r["config"]) == picked and r["split"] == (picked_split
                                                                                               if split else 1)), None)
        out.append({"launch": name, "n": n, "k": k, "quant": quant, "kind": kind, "rows": rows,
                    "split_product": split, "picked": [list(picked), picked_split, now], "best": timed[:keep]})
        best = timed[0]
        print(f"{kind:>5} {rows} row(s) {name:>18} {n}x{k}: picked {picked}/{picked_split} "
              f"{now if now is None else round(now, 2)} us, best {tuple(best['config'])}/{best['split']} "
              f"{best['us']:.2f} us", flush=True)
    return out


def entry_key(row: dict) -> str:
    kind = row.get("kind") or ("quant" if row["quant"] else "float")
    return f"{kind} {row['n']}x{row['k']} @{row['rows']}"


def table_entries(swept: list[dict], taken: dict[str, dict] | None = None) -> dict:
    """``launches.gemv`` of the new table: every swept launch at its current pick, or at a taken
    setting (``taken``: entry key -> fields)."""
    gemv = {}
    for row in swept:
        key = entry_key(row)
        fields = {"config": row["picked"][0]}
        if row["split_product"]:
            fields["split"] = row["picked"][1]
        gemv[key] = dict(fields, **(taken or {}).get(key, {}))
    return {"gemv": gemv}


def challengers(swept: list[dict], margin: float) -> dict[str, dict]:
    """Entry key -> the fields of the fastest setting that beat the current pick by ``margin``."""
    out = {}
    for row in swept:
        best, now = row["best"][0], row["picked"][2]
        if now is None or best["us"] < now * (1 - margin):
            fields = {"config": best["config"]}
            if row["split_product"]:
                fields["split"] = best["split"]
            out[entry_key(row)] = fields
    return out


def confirm(comfyui: str, base: Path, tries: dict[str, dict], folder: Path, repeat: int, margin: float) -> dict:
    """Each challenger as a variant of the base table in ``comfy_e2e.py``'s own step, one process;
    the challengers whose median tok/s beat the base's by ``margin``."""
    base_table = json.loads(base.read_text())
    variants = []
    for i, (key, fields) in enumerate(tries.items()):
        table = json.loads(json.dumps(base_table))
        table["launches"]["gemv"][key] = fields
        path = folder / f"try{i}.json"
        path.write_text(json.dumps(table))
        variants.append((f"try{i}", key, path))
    result = folder / "confirm.json"
    kinds = ["pack", "forced3"]
    formats = sorted({CONFIRM_ON[key.split()[0]] for key in tries})
    cmd = [sys.executable, str(ROOT / "benchmarks" / "comfy_e2e.py"), "--comfyui", comfyui, "--formats", *formats,
           "--kinds", *kinds, "--max-lengths", "4096", "--repeat", str(repeat), "--json", str(result),
           "--variants", f"base:{base}", *(f"{name}:{path}" for name, _, path in variants)]
    print("confirming in the step:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = json.loads(result.read_text())["rows"]

    def median(fmt, kind):
        return statistics.median(r["tok_s"] for r in rows if r["kind"] == kind and r["format"] == fmt)

    taken = {}
    for name, key, _ in variants:
        one_row = int(key.rpartition("@")[2]) == 1
        kind, fmt = "pack" if one_row else "pack-forced3", CONFIRM_ON[key.split()[0]]
        if median(fmt, f"{kind}@{name}") > median(fmt, f"{kind}@base") * (1 + margin):
            taken[key] = tries[key]
    return taken


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="9b")
    ap.add_argument("--comfyui", help="a ComfyUI tree: confirm the shortlist inside the whole step (comfy_e2e.py)")
    ap.add_argument("--formats", nargs="+", choices=sorted(KINDS), default=["int8", "bf16"],
                    help="weight formats whose launches are swept (w4a4 / nvfp4 need comfy-kitchen)")
    ap.add_argument("--quick", action="store_true", help="fewer candidates, no lm_head")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="rows of x to sweep at (1: decode)")
    ap.add_argument("--launches", nargs="+", metavar="NAME",
                    help="sweep only these launches (names as printed, e.g. 'DeltaNet inputs')")
    ap.add_argument("--keep", type=int, default=3, help="shortlist length per launch")
    ap.add_argument("--margin", type=float, default=0.01, help="what a setting must win by (0.01 = 1%%)")
    ap.add_argument("--repeat", type=int, default=3, help="comfy_e2e.py --repeat of the confirmation")
    ap.add_argument("--out", default=str(ROOT / "kernels" / "tuned"), help="folder the table is written to")
    ap.add_argument("--json", default="tune.json", help="the sweep's and the confirmation's results")
    args = ap.parse_args()
    names = {name for name, *_ in launches(args.size)}
    if args.launches and not set(args.launches) <= names:
        sys.exit(f"--launches: {sorted(set(args.launches) - names)} are no launch of the step; "
                 f"choose from {sorted(names)}")
    if not torch.cuda.is_available():
        sys.exit("tune.py times kernels on a CUDA GPU; none is visible here")
    record = device_record(torch.device("cuda"))
    swept = [r for fmt in args.formats for rows in args.rows
             for r in sweep_gemv(args.size, KINDS[fmt], rows, args.keep, args.quick, record, args.launches)]
    folder = Path(args.json).resolve().parent
    base = folder / "tune_base.json"
    base.write_text(json.dumps({"launches": table_entries(swept)}))
    tries = challengers(swept, args.margin)
    taken, how = tries, "launch sweep only (no --comfyui): not confirmed in the whole step"
    if args.comfyui and tries:
        taken = confirm(args.comfyui, base, tries, folder, args.repeat, args.margin)
        how = f"launch sweep, confirmed in the whole step (comfy_e2e.py --variants, --repeat {args.repeat})"
    import triton

    table = {"device": record.name, "arch": record.arch, "sms": record.sms,
             "provenance": {"gpu": record.name, "triton": triton.__version__, "torch": torch.__version__,
                            "dates": datetime.date.today().isoformat(), "model": f"Qwen3.5-{args.size.upper()}",
                            "how": how, "results": [str(Path(args.json))]},
             "launches": table_entries(swept, taken)}
    out = Path(args.out) / (record.name.replace(" ", "_").replace("/", "_") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    launch.read_table(out)  # what the pack will read
    Path(args.json).write_text(json.dumps({"swept": swept, "tried": tries, "taken": taken}, indent=1))
    print(f"wrote {out}: {len(taken)} launch(es) changed from the current picks")


if __name__ == "__main__":
    main()
