"""End-to-end decode speed of a 9B-shaped Qwen3.5 against max_length (GPU).

Builds a Qwen3.5-9B-shaped model with random bf16 weights directly on the GPU (about 19 GB, MTP
head included), feeds a 1,000-token prompt and generates 2,000 tokens greedily (no stop token) with
the cache allocated for ``prompt + max_length``, for every max_length, attention mode and MTP mode:

- attention: ``masked`` (today's ComfyUI: whole capacity + bias), ``kitchen`` (comfy-kitchen's GQA
  decode, when installed), ``triton`` (ours);
- MTP: ``off``; ``forced3`` (depth 3, every draft replaced by the token the target will choose, taken
  from the MTP-off run, so every draft is accepted: times draft + verify without a trained head;
  the head still runs); ``mtp3`` (depth 3, the random head's own drafts: the normal acceptance path).

Reports tok/s, ms/token (decode only), peak VRAM, and the weight-read floor: bytes of every weight
a decode step reads (all but the embedding table) / measured copy bandwidth.

Usage: python benchmarks/decode_e2e.py [--attention triton kitchen masked] [--max-lengths ...]
                                        [--tokens 2000] [--soak 200] [--json out.json] [--tiny (CPU dry run)]
       python benchmarks/decode_e2e.py --report runs.json   (README table of saved runs)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.engine import Qwen35Config, generate  # noqa: E402
from qwen35_fast.engine.modules import MTPHead, Qwen35ForGeneration, Qwen35TextModel  # noqa: E402

MAX_LENGTHS = (4096, 8192, 16256, 24000, 32768, 65536)


def config_9b(tiny: bool = False) -> Qwen35Config:
    """Qwen3.5-9B text dims (or a tiny stand-in of the same structure for a CPU dry run)."""
    if tiny:
        layers, h, inter, vocab, heads, kv, hd, lk, lv = 8, 128, 256, 512, 4, 2, 64, 2, 4
    else:
        layers, h, inter, vocab, heads, kv, hd, lk, lv = 32, 4096, 12288, 248320, 16, 4, 256, 16, 32
    return Qwen35Config(
        vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, linear_num_key_heads=lk,
        linear_num_value_heads=lv, linear_key_head_dim=32 if tiny else 128,
        linear_value_head_dim=32 if tiny else 128, conv_kernel_size=4,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        lm_head=True, mtp_num_hidden_layers=1)


@torch.no_grad()
def build_model(cfg: Qwen35Config, device, dtype, seed: int = 0) -> Qwen35ForGeneration:
    """Random weights in place on ``device``: small Linear weights, norms near their identity."""
    torch.manual_seed(seed)
    model = Qwen35TextModel(cfg, device=device, dtype=dtype)
    model.mtp = MTPHead(cfg, 1, device=device, dtype=dtype)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(0.0, math.log(16.0)))
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.1)
        elif name.endswith("linear_attn.norm.weight"):  # plain-w gated norm
            p.normal_(1.0, 0.1)
        elif p.dim() == 1:  # (1 + w) norms
            p.normal_(0.0, 0.1)
        elif "conv1d" in name:
            p.normal_(0.0, 0.3)
        else:
            p.normal_(0.0, 0.02)
    return Qwen35ForGeneration(model).eval()


def copy_bandwidth(device) -> float:
    """Device copy bandwidth in bytes/s (read + write counted)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t0)


class _Enough(Exception):
    pass


def run_one(model, prompt, *, max_length, tokens, attention, mtp, drafts=None):
    """Generate ``tokens`` tokens (the cache sized for max_length); returns (token ids, stats, peak GB)."""
    seen = {}

    def stop(all_tokens, new, stats):
        seen["tokens"], seen["stats"] = list(all_tokens), stats
        if len(all_tokens) >= tokens:
            raise _Enough

    kw = {}
    if drafts is not None:
        kw["mtp_draft"] = lambda position: drafts[position] if position < len(drafts) else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        generate(model, prompt, do_sample=False, max_length=max_length, stop_tokens=[], mtp=mtp,
                 attention=attention, callback=stop, **kw)
    except _Enough:
        pass
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return seen["tokens"][:tokens], seen["stats"], peak


def soak(model, cfg, device, dtype, n: int) -> dict:
    """n generations with varied max_length, MTP on/off, ~20% interrupted: VRAM after each one and
    whether repeated (seed, MTP) requests gave identical tokens (they must, whatever max_length)."""
    rng = random.Random(0)
    seen: dict[tuple, list[int]] = {}
    mem, mismatches, interrupted = [], 0, 0
    for i in range(n):
        seed, mtp = rng.randrange(6), rng.choice(["off", 3])
        max_length = rng.choice([48, 1000, 16256, 24000, 65536])
        stop_at = rng.randrange(3, 30) if rng.random() < 0.2 else 32
        g = torch.Generator(device=device).manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (1, 40 + 13 * seed), generator=g, device=device)
        prompt = model.model.embed_tokens(ids).to(dtype)
        got = {}

        def cb(all_tokens, new, stats, got=got, stop_at=stop_at):
            got["tokens"] = list(all_tokens)
            if len(all_tokens) >= stop_at:
                raise _Enough

        try:
            generate(model, prompt, do_sample=True, temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5,
                     seed=seed, max_length=max_length, stop_tokens=[], mtp=mtp, callback=cb)
        except _Enough:
            pass
        if stop_at < 32:
            interrupted += 1
        else:
            key = (seed, mtp)
            toks = got["tokens"][:32]
            if key in seen and seen[key] != toks:
                mismatches += 1
            seen.setdefault(key, toks)
        if device.type == "cuda":
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated())
        if (i + 1) % 20 == 0:
            print(f"soak {i + 1}/{n}: {interrupted} interrupted, {mismatches} mismatches, "
                  f"{(mem[-1] if mem else 0) / 2**30:.3f} GB allocated", flush=True)
    base = mem[9] if len(mem) > 10 else (mem[0] if mem else 0)
    growth = (max(mem[10:]) - base) / base if len(mem) > 10 and base else 0.0
    return {"generations": n, "interrupted": interrupted, "repeat_mismatches": mismatches,
            "distinct_requests": len(seen), "vram_base_gb": base / 2**30, "vram_growth": growth}


def markdown(runs: dict) -> str:
    """README table from a file of saved runs ({tag: run JSON})."""
    lines = ["| run | attention | max_length | MTP | tok/s | ms/token | accepted | peak GB | floor / time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for tag, run in runs.items():
        for r in run["rows"]:
            if r["max_length"] and run["tokens"] == 2000:
                lines.append(f"| {tag} | {r['attention']} | {r['max_length']} | {r['mode']} | {r['tok_s']:.1f} | "
                             f"{r['ms_per_token']:.2f} | {100 * r['acceptance']:.1f}% | {r['peak_gb']:.1f} | "
                             f"{100 * run['floor_ms'] / r['ms_per_token']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", nargs="+", default=["triton", "kitchen", "masked"])
    ap.add_argument("--max-lengths", nargs="+", type=int, default=list(MAX_LENGTHS))
    ap.add_argument("--modes", nargs="+", default=["off", "forced3", "mtp3"])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--json", default="decode_e2e.json")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny model")
    ap.add_argument("--soak", type=int, default=0, help="then run this many soak generations")
    ap.add_argument("--report", metavar="JSON", help="print the README table of saved runs and exit")
    args = ap.parse_args()
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    cfg = config_9b(args.tiny)
    model = build_model(cfg, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if not n.startswith("model.mtp.") and "embed_tokens" not in n)
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    floor_ms = weight_bytes / bw * 1e3
    name = "cpu" if args.tiny else torch.cuda.get_device_name(0)
    print(f"# {name}, torch {torch.__version__}; weights read per decode step {weight_bytes / 1e9:.2f} GB, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s, weight-read floor {floor_ms:.2f} ms/token")
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=gen, device=device)
    prompt = model.model.embed_tokens(ids).to(dtype)
    out = {"device": name, "torch": torch.__version__, "weight_bytes": weight_bytes, "copy_bw_Bps": bw,
           "floor_ms": floor_ms, "tokens": args.tokens, "prompt": args.prompt, "rows": []}
    print(f"{'attention':>9} {'max_len':>7} {'mode':>7} {'tok/s':>7} {'ms/tok':>7} {'accept':>6} {'peakGB':>6}"
          f" {'floor%':>6}")
    for attention in args.attention:
        for max_length in args.max_lengths:
            reference = None
            for mode in args.modes:
                mtp = "off" if mode == "off" else 3
                if mode == "forced3" and reference is None:
                    reference, _, _ = run_one(model, prompt, max_length=max_length, tokens=args.tokens,
                                              attention=attention, mtp="off")
                try:
                    toks, st, peak = run_one(model, prompt, max_length=max_length, tokens=args.tokens,
                                             attention=attention, mtp=mtp,
                                             drafts=reference if mode == "forced3" else None)
                except ValueError as exc:  # e.g. kitchen not installed
                    print(f"{attention:>9} {max_length:>7} {mode:>7} skipped: {exc}")
                    break
                if mode == "off":
                    reference = toks
                ms = 1e3 * st.decode_s / max(1, st.tokens - 1)
                row = {"attention": attention, "max_length": max_length, "mode": mode, "tok_s": st.tok_per_s,
                       "ms_per_token": ms, "acceptance": st.acceptance_rate, "steps": st.steps,
                       "peak_gb": peak, "same_tokens_as_off": toks == reference}
                out["rows"].append(row)
                print(f"{attention:>9} {max_length:>7} {mode:>7} {st.tok_per_s:>7.1f} {ms:>7.2f} "
                      f"{100 * st.acceptance_rate:>5.0f}% {peak:>6.1f} {100 * floor_ms / ms:>5.0f}%"
                      + ("" if row["same_tokens_as_off"] else "  TOKENS DIFFER FROM MTP OFF"), flush=True)
                Path(args.json).write_text(json.dumps(out, indent=1))
    if args.soak:
        out["soak"] = soak(model, cfg, device, dtype, args.soak)
        print("soak:", out["soak"])
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
