"""End-to-end decode speed of a 9B-shaped Qwen3.5 against max_length (GPU).

Builds a Qwen3.5-9B-shaped model with random bf16 weights directly on the GPU (about 19 GB, MTP
head included), feeds a 1,000-token prompt and generates 2,000 tokens greedily (no stop token) with
the cache allocated for ``prompt + max_length``, for every max_length, attention mode and MTP mode:

- attention: ``masked`` (today's ComfyUI: whole capacity + bias), ``kitchen`` (comfy-kitchen's GQA
  decode, when installed), ``triton`` (ours);
- MTP: ``off``; ``forced3`` (depth 3, every draft replaced by the token the target will choose, taken
  from the MTP-off run, so every draft is accepted: times draft + verify without a trained head;
  the head still runs; the model is built *decisive*, see ``build_model``, so that a 4-row verify
  and a 1-row decode cannot round to different tokens); ``mtp3`` (depth 3, the random head's own
  drafts: the normal acceptance path, here the all-rejected worst case);
- fused decode kernels on (``generate(fused="auto")``) and/or off (the torch path).

Reports tok/s, ms/token (decode only), peak VRAM, and the weight-read floor: bytes of every weight
a decode step reads (all but the embedding table) / measured copy bandwidth. ``--steps`` also
times single CUDA-graph steps (decode, 4-row verify, draft); ``--profile`` lists the kernels of an
eager step; ``--trace N`` profiles the host side of a generation.

Usage: python benchmarks/decode_e2e.py [--attention triton kitchen masked] [--max-lengths ...]
                                        [--modes off forced3 mtp3] [--fused on off] [--steps] [--profile]
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
from qwen35_fast.engine import Qwen35Config, bind, build_runner, generate  # noqa: E402
from qwen35_fast.engine.modules import MTPHead, Qwen35ForGeneration, Qwen35TextModel  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from benchmarks.timing import back_to_back_ms  # noqa: E402

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
def build_model(cfg: Qwen35Config, device, dtype, seed: int = 0, decisive: bool = True) -> Qwen35ForGeneration:
    """Random weights in place on ``device``: small Linear weights, norms near their identity.

    The model is made *decisive* so that forced acceptance works: the embedding has unit-variance
    entries, the projections back into the residual stream (``o_proj``, ``out_proj``,
    ``down_proj``) are 1e4 times smaller than the others, and ``lm_head`` is a copy of the
    embedding. The final hidden state is then the current token's embedding plus a small
    perturbation, so greedy decoding repeats the last token with a logit margin of thousands that
    no rounding difference between a 1-row and a 4-row forward can flip. Every weight is still
    random and read in full at every step, so the timing is that of any 9B-shaped model.
    ``decisive=False``: every projection and ``lm_head`` random at the same scale (tests that need
    answers sensitive to every weight).
    """
    torch.manual_seed(seed)
    model = Qwen35TextModel(cfg, device=device, dtype=dtype)
    model.mtp = MTPHead(cfg, 1, device=device, dtype=dtype)
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0)
        elif decisive and name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            p.normal_(0.0, 2e-6)
        elif name.endswith("A_log"):
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
    if cfg.lm_head and decisive:
        model.lm_head.weight.copy_(model.embed_tokens.weight)
    return Qwen35ForGeneration(model).eval()


class _Enough(Exception):
    pass


def _fused_arg(fused: bool, device):
    """generate()'s ``fused``: required on the CPU dry run (Triton interpreter), else auto."""
    return (True if device.type == "cpu" else "auto") if fused else False


def run_one(model, prompt, *, max_length, tokens, attention, mtp, drafts=None, fused=True):
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
                 attention=attention, callback=stop, fused=_fused_arg(fused, prompt.device), **kw)
    except _Enough:
        pass
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return seen["tokens"][:tokens], seen["stats"], peak


def _engine(model, prompt, *, attention: str, fused, capacity: int, graphs: bool = True, weight_cast=None,
            weights=None):
    """A prefilled cache and a (graph) runner over it, built by ``generate``'s own ``build_runner``
    (``weight_cast`` / ``weights``: the binding's hooks, see ``engine.bind``)."""
    binding = bind(model, weight_cast=weight_cast, weights=weights)
    device, dtype, t = prompt.device, prompt.dtype, prompt.shape[1]
    runner = build_runner(binding, capacity=capacity, dtype=dtype, device=device, attention=attention, mtp=True,
                          fused=fused, cuda_graphs=graphs and device.type == "cuda")
    cache = runner.cache
    pos = torch.arange(t, device=device).expand(3, t)
    with torch.no_grad():
        runner.forward(prompt, pos, keep_rows=False)
        cache.commit()
        runner.mtp_forward(prompt, prompt, pos)
        cache.mtp.commit()
    return binding, cache, runner


@torch.no_grad()
def step_times(model, prompt, *, attention: str, fused: bool, rows=(1, 4), iters: int = 200) -> dict:
    """Median ms of one model step (forward of ``rows`` rows + logits, CUDA-graph replays, rows
    discarded after each) and of one MTP draft step (1 row + logits), timed back to back with
    CUDA events, no host sync between steps."""
    binding, cache, runner = _engine(model, prompt, attention=attention, fused=fused,
                                     capacity=prompt.shape[1] + 64)
    t, device = prompt.shape[1], prompt.device
    cuda = device.type == "cuda"

    def timed(fn):
        return back_to_back_ms(fn, iters=iters)

    out = {}
    for r in rows:
        x = prompt[:, :r].contiguous()
        pos = torch.arange(t, t + r, device=device).expand(3, r)

        def main_step(x=x, pos=pos):
            hidden, _ = runner.forward(x, pos)
            binding.logits(hidden)
            cache.commit(0)

        out[f"step_{r}_ms"] = timed(main_step)
        if r == 1 and cuda:  # as generate runs it: the host waits for each token before the next step
            lat = []
            for _i in range(50):
                t0 = time.perf_counter()
                hidden, _ = runner.forward(x, pos)
                int(binding.logits(hidden)[0, -1].argmax())
                cache.commit(0)
                lat.append(1e3 * (time.perf_counter() - t0))
            out["synced_step_1_ms"] = sorted(lat)[25]
    h1, pos1 = prompt[:, :1].contiguous(), torch.arange(t, t + 1, device=device).expand(3, 1)

    def draft_step():
        binding.logits(runner.mtp_forward(h1, h1, pos1))
        cache.mtp.commit(0)

    out["draft_ms"] = timed(draft_step)
    return out


def _tally(events, device_type: str, time_of) -> dict[str, list]:
    """Profiler events of one device type (``"CUDA"`` / ``"CPU"``) by name: ``[count, time_of sum]``."""
    out: dict[str, list] = {}
    for ev in events:
        if ev.device_type.name == device_type:
            k = out.setdefault(ev.name, [0, 0.0])
            k[0] += 1
            k[1] += time_of(ev)
    return out


@torch.no_grad()
def profile_steps(model, prompt, *, attention: str, fused, steps: int = 5, top: int = 12, weight_cast=None,
                  weights=None) -> dict:
    """Kernels of eager 1-row decode steps (torch profiler): launches and kernel time per step, and
    the kernels that take the most time. ``weight_cast`` / ``weights``: the binding's hooks (a
    ComfyUI-loaded model: ``patches.comfy_bridge``'s)."""
    from torch.profiler import ProfilerActivity, profile

    binding, cache, runner = _engine(model, prompt, attention=attention, fused=fused,
                                     capacity=prompt.shape[1] + 64, graphs=False, weight_cast=weight_cast,
                                     weights=weights)
    t, device = prompt.shape[1], prompt.device
    x, pos = prompt[:, :1].contiguous(), torch.arange(t, t + 1, device=device).expand(3, 1)

    def step():
        hidden, _h = runner.forward(x, pos)
        binding.logits(hidden)
        cache.commit(0)

    step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        for _i in range(steps):
            step()
        sync()
    cuda = device.type == "cuda"
    kernels = _tally(prof.events(), "CUDA" if cuda else "CPU",
                     (lambda ev: ev.device_time) if cuda else (lambda ev: ev.cpu_time))
    launches = sum(c for c, _t in kernels.values()) / steps
    total_us = sum(tt for _c, tt in kernels.values()) / steps
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"launches_per_step": launches, "kernel_us_per_step": total_us,
            "top": [{"kernel": n[:90], "per_step": c / steps, "us_per_step": tt / steps} for n, (c, tt) in ranked]}


@torch.no_grad()
def profile_prefill(model, prompt, *, attention: str, fused, repeats: int = 3, top: int = 25, weight_cast=None,
                    weights=None) -> dict:
    """What a prompt's prefill costs: median wall ms of ``repeats`` prefills (main forward, commit,
    MTP head over the prompt; ``generate``'s own calls) and the kernels of one (torch profiler):
    time per kernel name, the largest ``top``, and the CPU ops by self time (host-bound parts)."""
    from torch.profiler import ProfilerActivity, profile

    binding = bind(model, weight_cast=weight_cast, weights=weights)
    device, dtype, t = prompt.device, prompt.dtype, prompt.shape[1]
    pos = torch.arange(t, device=device).expand(3, t)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def runner():  # a fresh cache per prefill, built outside the timed part
        r = build_runner(binding, capacity=t + 64, dtype=dtype, device=device, attention=attention, mtp=True,
                         fused=fused, cuda_graphs=False)
        sync()
        return r

    def prefill(r):
        r.forward(prompt, pos, keep_rows=False)
        r.cache.commit()
        r.mtp_forward(prompt, prompt, pos)
        r.cache.mtp.commit()

    prefill(runner())
    sync()
    walls = []
    for _i in range(repeats):
        r = runner()
        t0 = time.perf_counter()
        prefill(r)
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
        del r
    r = runner()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        prefill(r)
        sync()
    events = prof.events()
    kernels = _tally(events, "CUDA", lambda ev: ev.device_time) if cuda else {}
    ops = _tally(events, "CPU", lambda ev: ev.self_cpu_time_total)

    def ranked(d):
        by_time = sorted(d.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": n[:90], "count": c, "us": tt} for n, (c, tt) in by_time]
    return {"prompt_tokens": t, "wall_ms": sorted(walls)[len(walls) // 2],
            "kernel_ms": sum(tt for _c, tt in kernels.values()) / 1e3,
            "launches": sum(c for c, _t in kernels.values()), "top": ranked(kernels), "cpu_top": ranked(ops)}


@torch.no_grad()
def trace_generation(model, prompt, *, attention: str, tokens: int, top: int = 25) -> dict:
    """Host-side cost of a real greedy generation (MTP off, graphs on): the CPU ops that take the
    most self time per token (torch profiler), and GPU kernel time against wall time. CUDA activity
    tracing instruments every graph node, so ``cudaGraphLaunch`` reads far slower here (1.1 ms for a
    9B step on an H200) than untraced: compare with ``--steps``' synced step for the real cost."""
    from torch.profiler import ProfilerActivity, profile

    run_one(model, prompt, max_length=4096, tokens=16, attention=attention, mtp="off")  # compile, warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if prompt.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        _, st, _ = run_one(model, prompt, max_length=4096, tokens=tokens, attention=attention, mtp="off")
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:top]
    gpu_us = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA") if len(acts) > 1 else 0.0
    return {"tokens": tokens, "wall_ms_per_token": 1e3 * wall / tokens,
            "decode_ms_per_token": 1e3 * st.decode_s / max(1, st.tokens - 1),
            "gpu_kernel_ms_per_token": gpu_us / 1e3 / tokens,
            "cpu_top": [{"op": e.key[:80], "calls_per_token": e.count / tokens,
                         "self_cpu_us_per_token": e.self_cpu_time_total / tokens} for e in cpu]}


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
    lines = ["| run | attention | fused | max_length | MTP | tok/s | ms/token | accepted | peak GB | floor / time |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for tag, run in runs.items():
        for r in run["rows"]:
            if r["max_length"] and run["tokens"] == 2000:
                lines.append(f"| {tag} | {r['attention']} | {r.get('fused', 'off')} | {r['max_length']} | "
                             f"{r['mode']} | "
                             f"{r['tok_s']:.1f} | "
                             f"{r['ms_per_token']:.2f} | {100 * r['acceptance']:.1f}% | {r['peak_gb']:.1f} | "
                             f"{100 * run['floor_ms'] / r['ms_per_token']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", nargs="+", default=["triton", "kitchen", "masked"])
    ap.add_argument("--max-lengths", nargs="+", type=int, default=list(MAX_LENGTHS))
    ap.add_argument("--modes", nargs="+", default=["off", "forced3", "mtp3"])
    ap.add_argument("--fused", nargs="+", default=["on"], choices=["on", "off"],
                    help="fused decode kernels on (default) and/or off (the torch path) for the e2e rows")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--json", default="decode_e2e.json")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny model")
    ap.add_argument("--steps", action="store_true", help="first time single steps: decode, verify (4 rows), draft")
    ap.add_argument("--profile", action="store_true", help="first list the kernels of an eager decode step")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="first profile the host side of an N-token greedy generation")
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
    bw = copy_bandwidth() if device.type == "cuda" else float("nan")
    floor_ms = weight_bytes / bw * 1e3
    name = "cpu" if args.tiny else torch.cuda.get_device_name(0)
    print(f"# {name}, torch {torch.__version__}; weights read per decode step {weight_bytes / 1e9:.2f} GB, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s, weight-read floor {floor_ms:.2f} ms/token")
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=gen, device=device)
    prompt = model.model.embed_tokens(ids).to(dtype)
    out = {"device": name, "torch": torch.__version__, "weight_bytes": weight_bytes, "copy_bw_Bps": bw,
           "floor_ms": floor_ms, "tokens": args.tokens, "prompt": args.prompt, "rows": []}
    attention0 = args.attention[0]
    if args.profile:
        out["profile"] = {}
        for fused in args.fused:
            prof = profile_steps(model, prompt, attention=attention0, fused=fused == "on")
            out["profile"][fused] = prof
            print(f"# eager decode step, fused {fused}: {prof['launches_per_step']:.0f} launches, "
                  f"{prof['kernel_us_per_step']:.0f} us of kernels")
            for k in prof["top"]:
                print(f"#   {k['us_per_step']:8.1f} us {k['per_step']:5.0f}x  {k['kernel']}")
    if args.trace:
        tr = out["trace"] = trace_generation(model, prompt, attention=attention0, tokens=args.trace)
        print(f"# traced generation: {tr['decode_ms_per_token']:.2f} ms/token decode, GPU kernels "
              f"{tr['gpu_kernel_ms_per_token']:.2f} ms/token; CPU self time per token:")
        for e in tr["cpu_top"]:
            print(f"#   {e['self_cpu_us_per_token']:8.1f} us {e['calls_per_token']:6.1f}x  {e['op']}")
    if args.steps:
        out["steps"] = {}
        for fused in args.fused:
            st = step_times(model, prompt, attention=attention0, fused=fused == "on")
            st["verify_over_decode"] = st["step_4_ms"] / st["step_1_ms"]
            st["floor_over_decode"] = floor_ms / st["step_1_ms"]
            out["steps"][fused] = st
            print(f"# graph steps, fused {fused}: decode {st['step_1_ms']:.3f} ms "
                  f"({100 * st['floor_over_decode']:.0f}% of floor), verify 4 rows {st['step_4_ms']:.3f} ms "
                  f"({st['verify_over_decode']:.2f}x), "
                  f"draft {st['draft_ms']:.3f} ms; {st.get('synced_step_1_ms', float('nan')):.3f} ms with a host "
                  "sync per token", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"{'attention':>9} {'fused':>5} {'max_len':>7} {'mode':>7} {'tok/s':>7} {'ms/tok':>7} {'accept':>6} "
          f"{'peakGB':>6} {'floor%':>6}")
    for attention in args.attention:
        for fused in args.fused:
            for max_length in args.max_lengths:
                reference = None
                for mode in args.modes:
                    mtp = "off" if mode == "off" else 3
                    kw = {"attention": attention, "tokens": args.tokens, "max_length": max_length,
                          "fused": fused == "on"}
                    if mode == "forced3" and reference is None:
                        reference, _, _ = run_one(model, prompt, mtp="off", **kw)
                    try:
                        toks, st, peak = run_one(model, prompt, mtp=mtp,
                                                 drafts=reference if mode == "forced3" else None, **kw)
                    except ValueError as exc:  # e.g. kitchen not installed
                        print(f"{attention:>9} {fused:>5} {max_length:>7} {mode:>7} skipped: {exc}")
                        break
                    if mode == "off":
                        reference = toks
                    ms = 1e3 * st.decode_s / max(1, st.tokens - 1)
                    row = {"attention": attention, "fused": fused, "max_length": max_length, "mode": mode,
                           "tok_s": st.tok_per_s, "ms_per_token": ms, "acceptance": st.acceptance_rate,
                           "steps": st.steps, "peak_gb": peak, "same_tokens_as_off": toks == reference}
                    out["rows"].append(row)
                    print(f"{attention:>9} {fused:>5} {max_length:>7} {mode:>7} {st.tok_per_s:>7.1f} {ms:>7.2f} "
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
