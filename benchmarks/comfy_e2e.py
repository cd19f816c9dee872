"""End-to-end decode speed inside a real ComfyUI, on models loaded by ComfyUI's own loader (GPU).

What a user runs: a Qwen3.5-9B-shaped checkpoint in ComfyUI's own formats, loaded with
``comfy.sd.load_clip`` (through the pack's loader node function, which calls it and grafts the
file's MTP head; ``--loader core``: directly, as core 'Load CLIP' does, which with ``--dynamic`` gives
the DynamicVRAM CLIP the patch reloads resident), then generated from in one process by

- ``core``: the unpatched CLIP's ``generate`` (core ComfyUI's decode, capacity-bound);
- ``pack``: the CLIP returned by the pack's patch (``patch_clip``, what the patch node outputs),
  MTP off: ``clip.generate`` routed to the engine on ComfyUI's own modules, weights resolved in
  place (``patches/comfy_weights.py``), fused kernels, CUDA graphs;
- ``pack-sampled``: the pack sampling with the prompt enhancer's text-to-image settings (top-k 20,
  top-p 0.95, presence penalty 1.5), MTP off: the sampling path of the decode loop;
- ``mtp-sampled``: the same settings through a patch with MTP depth 3 (the enhancer's default):
  the random head's drafts are rejected nearly always, so this times a sampled draft + verify
  cycle per token or two, not MTP's gain;
- ``pack-plain``: the same as ``pack`` with every kernel launched plainly (``QWEN35_FAST_PDL=0``: no
  programmatic dependent launch, ``kernels/pdl.py``), what a GPU before Hopper gets;
- ``pack-forced3``: the engine on the same ComfyUI modules with MTP depth 3, every draft replaced
  by the token the target will choose (from the MTP-off run), so every draft is accepted: the
  speed of draft + verify without a trained head (the head still runs). This row calls
  ``engine.generate`` with the benchmark's draft hook, bound exactly as the patch binds;
- ``pack-forced3-subset`` (kind ``forced3-subset``): the same with the drafts ranking the released
  tokenizer's first 151,643 ids (``draft_vocab="subset"``, ``engine/draft_vocab.py``), what English,
  Chinese and code text runs: the random weights' tokens spread over every id, so ``forced3``'s
  default ``"auto"`` gives the cut up within its first tokens;
- ``standalone``: the engine's own loader on the same file (after ComfyUI's copy is unloaded).

Formats: ``bf16`` (manual_cast ops) and ``int8`` (``int8_tensorwise`` + ConvRot 256 per layer,
written as ComfyUI's save path writes it: ``<layer>.weight`` int8, ``<layer>.weight_scale`` float32
per row, ``<layer>.comfy_quant`` JSON, quantized by comfy-kitchen's own quantizer; every Linear of
the decoder layers and ``lm_head``; embeddings, norms, conv and the MTP head stay bf16).

The weights are random but *decisive* (``benchmarks.decode_e2e.build_model``): greedy decoding
repeats the last token with a large logit margin, so 1-row and 4-row steps cannot round apart and
forced acceptance works; every weight is still read in full at every step. The prompt is 960 words
of text through the CLIP's tokenizer (2472 tokens; each row records ``prompt_tokens``; the
standalone row gets as many).

Timing: decode tok/s = (tokens - 8) / (time of the last token - time of the 8th), from ComfyUI's
progress-bar updates (both core and the pack report every token; a generation's first steps
capture its CUDA graphs, about 0.1-0.5 s once per generation); what the user waits for is there
too: first token s (the call to the first token, prefill included) and end-to-end tok/s (tokens /
the call to the last token, prefill and captures included); a warm-up generation first,
then rows in interleaved order per max_length. The warm-ups' wall times are kept as ``first-use``
rows (MTP off, and forced MTP-3 when ``--kinds`` names forced3; 32 tokens each): what a first
generation of the process costs, Triton's compiles included unless its disk cache has the kernels.
Floor = bytes one decode step reads (every weight but the embedding table) / measured copy
bandwidth. Peak VRAM = torch's max allocated per row.
``--memory``: at the first max_length, what the core and pack rows themselves allocate at their
peak, by call site (``benchmarks/memory_peak.py``). ``--profile``: the kernels of an eager 1-row
step and the host's Python functions per token of a generation (cProfile, after a warm-up
generation; also of a forced3 one when ``--kinds`` names it), per format.
``--profile-prefill``: median wall time of the prompt's prefill (main forward and MTP head, a fresh
cache each) and its kernels and host ops (torch profiler), per format.
``--variants NAME:TABLE.json``: more MTP-off pack rows (``pack@NAME``; with forced3 in ``--kinds``
also forced MTP-3 rows, ``pack-forced3@NAME``, right after the forced3 row), each run with a launch
table pinned over the GPU's own (``kernels/launch.py``: its entries win, field by field), right
after the pack row; with ``--repeat N`` the rows of each max_length run N times over in that order:
settings compared in one process, on one loaded model, interleaved; the table then ends with each
pack kind's median tok/s and its ratio to the pack row's (a forced MTP-3 variant's: to the forced3
row's; ``compare``).
``--accept P ...``: only MTP off, fixed depths 1..5 and ``mtp="auto"`` with drafts kept with
probability P, greedy and sampled (``benchmarks/mtp_accept.py``; ``--repeat`` runs each P's rows
again, interleaved).
``--no-triton``: the whole run with ``import triton`` failing (``benchmarks/without_triton.py``), as
on a Windows ComfyUI without triton-windows; its rows are named ``<kind>-notriton``.
``--timeline``: the GPU timeline of a token (``benchmarks/timeline.py``), pack and pack-plain (and forced3 and
forced3-plain when ``--kinds`` names forced3: per token is per verify step / 4).

Usage (a ComfyUI tree on sys.path; comfy-kitchen installed):
    python benchmarks/comfy_e2e.py --comfyui /path/to/ComfyUI [--formats bf16 int8 fp8 w4a4 nvfp4]
        [--max-lengths 4096 24000 65536] [--core-max-lengths 4096 24000] [--tokens 300]
        [--core-tokens 100] [--json out.json] [--size 9b|0.8b] [--dir /dev/shm/qwen35] [--profile] [--memory]
        [--profile-prefill] [--kinds core pack pack-sampled mtp-sampled pack-plain forced3 standalone] [--timeline]
        [--variants NAME:TABLE.json ...] [--repeat N]
    python benchmarks/comfy_e2e.py --report runs.json      (README table of a saved run)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from qwen35_fast.engine import Qwen35Config  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from benchmarks.decode_e2e import build_model, config_9b  # noqa: E402
from benchmarks.memory_peak import PeakProbe  # noqa: E402
from benchmarks.without_triton import hidden as triton_hidden  # noqa: E402
from benchmarks.without_triton import restart as restart_without_triton  # noqa: E402

log = logging.getLogger("comfy_e2e")
HF = "model.language_model."


def config_08b() -> Qwen35Config:
    """Qwen3.5-0.8B text dims (ComfyUI picks the size from the hidden width; for a CPU dry run)."""
    layers = 24
    return Qwen35Config(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, conv_kernel_size=4,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        lm_head=False, mtp_num_hidden_layers=1)


def _quantized_layer(name: str, t: torch.Tensor) -> bool:
    """The Linear weights the int8 file quantizes: decoder layers and lm_head (width a multiple of 256)."""
    if t.dim() != 2 or t.shape[1] % 256 or "conv1d" in name or name.startswith("mtp."):
        return False
    return name.startswith("layers.") or name == "lm_head.weight"


#: ``--formats`` name -> the 4-bit format of its files' layers, written as the converter writes them
#: (``patches/quant_values.quantized``: comfy-kitchen's quantizers, convrot_w4a4 rows clipped first)
FOUR_BIT = {"w4a4": "convrot_w4a4", "nvfp4": "nvfp4"}


@torch.no_grad()
def write_checkpoint(path: Path, fmt: str, cfg: Qwen35Config, device, decisive: bool = True, seed: int = 0) -> None:
    """A random checkpoint (decisive by default, see ``build_model``) in the HF key layout ComfyUI
    loads, bf16, int8_convrot, fp8 (float8_e4m3fn, one scale per tensor), w4a4 (convrot_w4a4) or nvfp4
    (the decoder layers in 4 bits, ``lm_head`` int8_convrot, the embedding int8 with a scale per row:
    what the converter makes of the official file)."""
    from safetensors.torch import save_file

    model = build_model(cfg, device, torch.bfloat16, seed=seed, decisive=decisive).model
    sd, tensors = {}, model.state_dict()
    untied = "lm_head.weight" in tensors
    for name, t in tensors.items():
        key = name if name.startswith("mtp.") or name == "lm_head.weight" else HF + name
        if fmt == "fp8" and _quantized_layer(name, t):  # ComfyUI's float8_e4m3fn format, per-tensor scale
            import comfy_kitchen as ck

            scale = (t.abs().amax() / torch.finfo(torch.float8_e4m3fn).max).float()
            sd[key] = ck.quantize_per_tensor_fp8(t, scale, torch.float8_e4m3fn).cpu()
            layer = key[:-len(".weight")]
            sd[layer + ".weight_scale"] = scale.cpu()
            conf = {"format": "float8_e4m3fn"}
            sd[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        elif fmt in FOUR_BIT and (_quantized_layer(name, t) and name != "lm_head.weight"
                                  or name.endswith("embed_tokens.weight") and untied):
            from qwen35_fast.patches.quant_values import quantized  # the converter's own tensors

            tensors, conf = quantized(t, "int8" if name.endswith("embed_tokens.weight") else FOUR_BIT[fmt])
            sd.update({key + suffix: v.cpu() for suffix, v in tensors.items()})
            sd[key[:-len(".weight")] + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()),
                                                                      dtype=torch.uint8)
        elif fmt in ("int8", *FOUR_BIT) and _quantized_layer(name, t):  # 4-bit files: lm_head int8, as converted
            from comfy_kitchen.tensor import TensorWiseINT8Layout

            q, params = TensorWiseINT8Layout.quantize(t, is_weight=True, per_channel=True, convrot=True,
                                                      convrot_groupsize=256)
            layer = key[:-len(".weight")]
            sd[key] = q.cpu()
            sd[layer + ".weight_scale"] = params.scale.float().reshape(-1, 1).cpu()
            conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
            sd[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        else:
            sd[key] = t.contiguous().cpu()
    del model, tensors
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(sd, str(tmp))
    tmp.replace(path)


def decode_bytes(path: Path) -> int:
    """Bytes a decode step reads: every tensor of the file but the embedding table, the MTP head and
    the int8 metadata (the MTP head runs only in the MTP rows)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            if ".embed_tokens." in key or key.endswith(".comfy_quant") or key.startswith("mtp."):
                continue
            sl = f.get_slice(key)
            n = 1
            for d in sl.get_shape():
                n *= d
            total += n * {"BF16": 2, "F32": 4, "I8": 1, "U8": 1, "F16": 2, "F8_E4M3": 1}[sl.get_dtype()]
    return total


class _Enough(Exception):
    pass


class TokenClock:
    """Wraps ComfyUI's ``ProgressBar.update_absolute`` (this process only): records when each token
    is reported and stops the generation after ``limit`` tokens (core's loop has no other exit).
    ``tick`` does the same for a generation that reports through an engine callback instead."""

    def __init__(self, comfy_utils):
        self.utils = comfy_utils
        self.original = comfy_utils.ProgressBar.update_absolute
        self.limit, self.times = float("inf"), []
        clock = self

        def update_absolute(bar, value, total=None, preview=None):
            clock.original(bar, value, total, preview)
            clock.tick(value)

        comfy_utils.ProgressBar.update_absolute = update_absolute

    def tick(self, value: int) -> None:
        """``value`` tokens are out now; stop the generation at the limit."""
        self.times.append((value, time.perf_counter()))
        if value >= self.limit:
            raise _Enough

    def run(self, fn, limit: int, skip: int = 8, stop: bool = True) -> float:
        """Call ``fn`` until ``limit`` tokens were reported (``stop=False``: ``fn`` ends there by itself,
        with no exception through the generation, so the pack keeps its decode stack as after a
        ComfyUI run); decode tok/s from token ``skip`` on (the first steps of a generation capture its
        CUDA graphs; the prefill is before the first token).
        ``last`` then holds what the user waits for: ``first_token_s`` (the call to the first token:
        prefill included) and ``wall_s`` (the call to the last token), and ``end_to_end_tok_s``; and
        how the timed tokens came: ``tokens_per_update`` (mean tokens a progress update reported: 1
        without MTP, up to depth + 1 with it) and the updates' spacing, ``update_ms`` (median, 90th
        percentile, largest)."""
        self.limit, self.times = limit if stop else float("inf"), []
        start = time.perf_counter()
        try:
            fn()
        except _Enough:
            pass
        finally:
            self.limit = float("inf")
        (v0, t0), (v1, t1) = next(((v, t) for v, t in self.times if v >= skip), self.times[0]), self.times[-1]
        if v1 < limit:
            raise RuntimeError(f"generation stopped after {v1} of {limit} tokens")
        timed = [(v, t) for v, t in self.times if v >= v0]
        gaps = sorted(1e3 * (b[1] - a[1]) for a, b in zip(timed, timed[1:])) or [0.0]
        spread = (statistics.median(gaps), gaps[int(0.9 * (len(gaps) - 1))], gaps[-1])
        self.last = {"first_token_s": self.times[0][1] - start, "wall_s": t1 - start,
                     "end_to_end_tok_s": v1 / (t1 - start), "tokens_per_update": (v1 - v0) / max(1, len(timed) - 1),
                     "update_ms": [round(g, 3) for g in spread]}
        return (v1 - v0) / (t1 - t0)


def setup_comfyui(tree: str, dynamic: bool):
    """Import ComfyUI from ``tree`` in process (as main.py configures it, without its server)."""
    sys.path.insert(0, tree)
    if dynamic:  # as main.py: comfy-aimdo is initialised before any comfy module binds its library
        import comfy_aimdo.control

        comfy_aimdo.control.init()
    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
    if dynamic:  # main.py's DynamicVRAM switch
        import comfy.memory_management
        import comfy.model_management
        import comfy.model_patcher

        ok = comfy_aimdo.control.init_devices(d.index for d in comfy.model_management.get_all_torch_devices())
        if not ok:
            raise RuntimeError("comfy-aimdo did not initialise: no DynamicVRAM here")
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    import comfy.model_management
    import comfy.sd
    import comfy.utils

    return comfy


def prompt_tokens(clip, n_words: int):
    text = " ".join(f"word{i % 97} colour{i % 13}" for i in range(n_words // 2))
    return clip.tokenize(text)


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def bench_format(comfy, fmt: str, path: Path, args, clock: TokenClock, bw: float) -> list[dict]:
    from qwen35_fast.engine import generate
    from qwen35_fast.patches import comfy_bridge as bridge
    from qwen35_fast.patches import comfy_weights
    from qwen35_fast.patches.clip_loader import load_qwen35_clip
    from qwen35_fast.patches.clip_patch import patch_clip

    floor_ms = decode_bytes(path) / bw * 1e3 if bw else 0.0
    if args.loader == "core":  # core 'Load CLIP': with --dynamic, the streamed CLIP the patch reloads
        loaded = None
        clip = comfy.sd.load_clip(ckpt_paths=[str(path)], clip_type=comfy.sd.CLIPType.QWEN_IMAGE)
    else:
        loaded = load_qwen35_clip(str(path), None)
        clip = loaded.clip
    dynamic = comfy_weights.is_dynamic(clip.patcher)
    print(f"# {fmt}: loaded by the {args.loader} loader, DynamicVRAM {'on' if dynamic else 'off'}", flush=True)
    tokens = prompt_tokens(clip, args.prompt)
    patched = patch_clip(clip, mtp="off")
    rows = []
    meta = {}  # the prompt's token count, once its embeddings exist

    suffix = "-notriton" if triton_hidden() else ""

    def row(kind, max_length, tok_s, **extra):
        kind += suffix
        r = {"format": fmt, "kind": kind, "max_length": max_length, "tok_s": tok_s, **meta,
             "ms_per_token": 1e3 / tok_s, "peak_gb": peak_gb(), "floor_ms": floor_ms,
             "floor_pct": 100 * floor_ms * tok_s / 1e3, **clock.last, **extra}
        rows.append(r)
        print(f"{fmt:>5} {kind:>13} max_length {max_length:>6}: {tok_s:8.1f} tok/s {r['ms_per_token']:7.2f} ms/token "
              f"peak {r['peak_gb']:6.2f} GB floor {floor_ms:.2f} ms ({r['floor_pct']:.0f}%); first token "
              f"{r['first_token_s']:.2f} s, {r['end_to_end_tok_s']:.1f} tok/s end to end; "
              f"{r['tokens_per_update']:.2f} tokens an update, ms apart {r['update_ms']}", flush=True)
        if "peak_allocations" in r:
            mem = r["peak_allocations"]
            print(f"      allocated by the row at its peak: {mem['peak_bytes'] / 2**30:.2f} GB; largest:", flush=True)
            for a in mem["by_site"][:8]:
                print(f"      {a['bytes'] / 2**20:9.1f} MiB in {a['count']:4d}  {' < '.join(a['where'][:3])}",
                      flush=True)

    def first_use(kind, last):
        kind += suffix
        rows.append({"format": fmt, "kind": kind, "tokens": 32, **last})
        print(f"{fmt:>5} {kind}: 32 tokens in {last['wall_s']:.2f} s (kernels compiled unless Triton's cache "
              f"had them, graphs captured)", flush=True)

    greedy = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0,
                  presence_penalty=0.0)
    # Warm-up (kernels compiled, graphs captured once, the model loaded on the GPU). Its wall time
    # is what a first generation costs (Triton compiles on first use unless its disk cache has them).
    clock.run(lambda: patched.generate(tokens, max_length=64, **greedy), 32)
    first_use("first-use", clock.last)
    target = bridge.find_qwen35(patched)
    embeds, _ = bridge.prompt_embeds(target, tokens, comfy.model_management.get_torch_device())
    meta["prompt_tokens"] = n_prompt = int(embeds.shape[1])
    for kind in [k for k in ("forced3", "forced3-subset") if k in args.kinds]:  # compiles the 4-row kernels
        drafts = forced_drafts(target, embeds, 40, greedy)
        clock.run(lambda: bridge.run_engine(target, embeds, max_length=64, mtp=3,
                                            mtp_draft=lambda pos: drafts[pos] if pos < len(drafts) else 0,
                                            draft_vocab=forced_vocab(kind), **greedy), 32)
        first_use(f"first-use {kind}", clock.last)
    from qwen35_fast.enhancer.prompt_enhancer import PRESETS

    sampled = dict(greedy, do_sample=True, **PRESETS["text-to-image"])
    if "mtp-sampled" in args.kinds:
        patched_mtp = patch_clip(clip, mtp=3)
        clock.run(lambda: patched_mtp.generate(tokens, max_length=64, **sampled), 32)
        first_use("first-use mtp-sampled", clock.last)
    if args.accept:
        from qwen35_fast.engine import bind

        from benchmarks.mtp_accept import sweep

        modes = {"greedy": greedy, "sampled": sampled}
        rows += sweep(fmt, target, embeds, clock, ps=args.accept, tokens=args.tokens,
                      modes={m: modes[m] for m in args.accept_modes},
                      vocab=bind(target.transformer).config.vocab_size, repeat=args.repeat)
        comfy.model_management.unload_all_models()
        patched = target = embeds = clip = loaded = None
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return rows
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # the pack's execution dtype
    hooks = dict(weight_cast=bridge.comfy_weight_cast, weights=bridge.WEIGHTS)  # the patch's binding hooks
    if args.profile:
        from benchmarks.decode_e2e import profile_steps

        prof = profile_steps(target.transformer, embeds.to(dtype), attention="auto", fused="auto", top=60, **hooks)
        rows.append({"format": fmt, "kind": "profile", **prof})
        print(f"{fmt:>5} eager 1-row step: {prof['launches_per_step']:.0f} launches, "
              f"{prof['kernel_us_per_step'] / 1e3:.2f} ms of kernels", flush=True)
        for k in prof["top"]:
            print(f"      {k['us_per_step']:8.1f} us  x{k['per_step']:5.1f}  {k['kernel']}", flush=True)
        n = min(120, args.tokens)
        runs = {"host_profile": lambda: patched.generate(tokens, max_length=4096, **greedy)}
        if "forced3" in args.kinds:
            drafts = forced_drafts(target, embeds, n + 8, greedy)
            runs["host_profile forced3"] = lambda: bridge.run_engine(
                target, embeds, max_length=4096, mtp=3, mtp_draft=lambda pos: drafts[pos] if pos < len(drafts) else 0,
                **greedy)
        for kind, run in runs.items():
            clock.run(run, n)  # a warm-up: kernels compiled for this path's row counts
            host = host_profile(lambda: clock.run(run, n), n)
            rows.append({"format": fmt, "kind": kind, **host})
            print(f"{fmt:>5} {kind}, per token of a generation (cProfile, graphs on):", flush=True)
            for f in host["top"][:30] + [None] + host["top_self"][:30]:
                if f is None:
                    print("      by self time:", flush=True)
                    continue
                print(f"      {f['cum_us']:8.1f} us cum {f['self_us']:8.1f} us self  x{f['calls']:5.1f}  "
                      f"{f['function']}", flush=True)

    if args.profile_prefill:
        from benchmarks.decode_e2e import profile_prefill

        pre = profile_prefill(target.transformer, embeds.to(dtype), attention="auto", fused="auto", **hooks)
        rows.append({"format": fmt, "kind": "prefill_profile", **pre})
        print(f"{fmt:>5} prefill of {pre['prompt_tokens']} tokens: {pre['wall_ms']:.1f} ms wall, "
              f"{pre['kernel_ms']:.1f} ms of kernels in {pre['launches']} launches", flush=True)
        for k in pre["top"]:
            print(f"      {k['us'] / 1e3:8.2f} ms  x{k['count']:5d}  {k['name']}", flush=True)
        print("      host, by self time:", flush=True)
        for k in pre["cpu_top"][:15]:
            print(f"      {k['us'] / 1e3:8.2f} ms  x{k['count']:5d}  {k['name']}", flush=True)

    if args.timeline:
        from benchmarks.timeline import print_timeline, token_timeline

        forced = ("forced3", "forced3-plain") if "forced3" in args.kinds else ()
        for kind in ("pack", "pack-plain") + forced:
            if kind in forced:  # per token = per verify step / 4 (every draft accepted)
                drafts = forced_drafts(target, embeds, args.tokens + 8, greedy)
                # A longer window than MTP off: the prompt rows' gaps do not cancel out exactly.
                with launches("pack-plain" if kind.endswith("plain") else "pack"):
                    tl = token_timeline(lambda n: clock.run(lambda: bridge.run_engine(
                        target, embeds, max_length=4096, mtp=3,
                        mtp_draft=lambda pos: drafts[pos] if pos < len(drafts) else 0, **greedy), n),
                        long=max(60, args.tokens - 20), steps=4)
            else:
                with launches(kind):
                    tl = token_timeline(lambda n: clock.run(lambda: patched.generate(tokens, max_length=4096,
                                                                                     **greedy), n))
            rows.append({"format": fmt, "kind": f"timeline {kind}", **tl})
            print_timeline(f"{fmt:>5} {kind} timeline", tl)

    variants = dict(args.variants)
    for max_length in args.max_lengths:
        order = [k for k in ("pack", "pack-sampled", "mtp-sampled", "pack-plain", "forced3", "forced3-subset", "core")
                 if k in args.kinds
                 and (k != "core" or max_length in args.core_max_lengths)]
        at = order.index("pack") + 1 if "pack" in order else 0  # next to the row they are compared with
        order[at:at] = [f"pack@{name}" for name in variants]
        if "forced3" in order:
            at = order.index("forced3") + 1
            order[at:at] = [f"forced3@{name}" for name in variants]
        for kind in order * args.repeat:
            reset_peak()
            probe = PeakProbe(args.memory and max_length == args.max_lengths[0] and kind in ("core", "pack"))
            if kind == "core":
                with probe:
                    tok_s = clock.run(lambda m=max_length: clip.generate(tokens, max_length=m, **greedy),
                                      args.core_tokens)
                row("core", max_length, tok_s, **({"peak_allocations": probe.result} if probe.result else {}))
            elif kind in ("pack-sampled", "mtp-sampled"):
                model = patched if kind == "pack-sampled" else patched_mtp
                tok_s = clock.run(lambda m=max_length: model.generate(tokens, max_length=m, **sampled), args.tokens)
                row(kind, max_length, tok_s)
            elif kind.startswith("pack"):
                with probe, launches(kind, variants.get(kind.partition("@")[2])):
                    tok_s = clock.run(lambda m=max_length: patched.generate(tokens, max_length=m, **greedy),
                                      args.tokens)
                row(kind, max_length, tok_s, **({"peak_allocations": probe.result} if probe.result else {}))
            else:
                # The MTP-off token sequence (the drafts to force), then depth 3 with those drafts.
                drafts = forced_drafts(target, embeds, args.tokens + 8, greedy)
                reset_peak()
                variant = kind.partition("@")[2]
                with launches(kind, variants.get(variant)):
                    tok_s = clock.run(lambda m=max_length: bridge.run_engine(
                        target, embeds, max_length=m, mtp=3, draft_vocab=forced_vocab(kind),
                        mtp_draft=lambda pos: drafts[pos] if pos < len(drafts) else 0, **greedy), args.tokens)
                row("pack-" + kind, max_length, tok_s)
    comfy.model_management.unload_all_models()
    patched = patched_mtp = target = embeds = clip = loaded = None
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "standalone" in args.kinds and fmt == "bf16":  # the standalone loader reads plain float files
        from qwen35_fast.engine import load_standalone

        model = load_standalone(str(path), device=comfy.model_management.get_torch_device(), dtype=torch.bfloat16)
        emb = embeds_like(model, n_prompt)  # as long as the ComfyUI rows' prompt
        for max_length in args.max_lengths[:1]:
            reset_peak()

            def standalone(m=max_length):
                generate(model, emb, do_sample=False, max_length=m, stop_tokens=[], mtp="off",
                         callback=lambda all_tokens, new, stats: clock.tick(len(all_tokens)))

            clock.run(standalone, args.tokens)  # a warm-up: kernels compiled for this model
            row("standalone", max_length, clock.run(standalone, args.tokens))
        del model
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def forced_vocab(kind: str) -> str:
    """The ``draft_vocab`` a forced MTP-3 kind runs with: "subset" for ``forced3-subset``, else the default."""
    return "subset" if kind.partition("@")[0] == "forced3-subset" else "auto"


def forced_drafts(target, embeds, n: int, greedy: dict) -> list[int]:
    """The MTP-off greedy tokens (n of them): the drafts a forced-acceptance MTP run is given."""
    from qwen35_fast.patches import comfy_bridge as bridge

    return list(bridge.run_engine(target, embeds, max_length=n, mtp="off", **greedy))


@contextlib.contextmanager
def launches(kind: str, table: str | None = None):
    """The launch settings of a pack row, restored after: ``pack-plain`` without programmatic
    dependent launch; a ``--variants`` row with its launch table pinned (``launch.pinned``)."""
    from qwen35_fast.kernels import capabilities, launch

    saved = os.environ.get(capabilities.PDL_ENV)
    if kind == "pack-plain":
        os.environ[capabilities.PDL_ENV] = "0"
    try:
        with launch.pinned(*([table] if table else [])):
            yield
    finally:
        if saved is None:
            os.environ.pop(capabilities.PDL_ENV, None)
        else:
            os.environ[capabilities.PDL_ENV] = saved


def parse_variant(text: str) -> tuple[str, str]:
    """``NAME:TABLE.json`` -> ``(NAME, path)``, the table read and checked (``launch.read_table``);
    argparse.ArgumentTypeError naming the form or the table's fault otherwise."""
    from qwen35_fast.kernels import launch

    name, sep, path = text.partition(":")
    if not sep or not name.strip() or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"--variants {text!r}: expected NAME:TABLE.json (NAME in letters, digits, "
                                         "'-', '_'), e.g. 'down2:variants/down2.json'")
    try:
        launch.read_table(path)
    except launch.TableError as exc:
        raise argparse.ArgumentTypeError(f"--variants {text!r}: {exc}") from None
    return name.strip(), path


def host_profile(fn, tokens: int, top: int = 40) -> dict:
    """Python functions of ``fn()`` (a generation of ``tokens`` tokens) by cumulative time per
    token (``top``) and by their own time (``top_self``; cProfile: its own overhead inflates every
    call, so read shares, not absolute times)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [{"function": f"{Path(file).parent.name}/{Path(file).name}:{line} {name}", "calls": nc / tokens,
             "self_us": tt / tokens * 1e6, "cum_us": ct / tokens * 1e6}
            for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.items()]
    by_self = sorted(rows, key=lambda r: -r["self_us"])
    rows.sort(key=lambda r: -r["cum_us"])
    return {"tokens": tokens, "top": rows[:top], "top_self": by_self[:top]}


def embeds_like(model, n: int):
    """A prompt of ``n`` token embeddings ``[1, n, H]`` (bf16) for the standalone model."""
    ids = torch.arange(n, device=model.model.embed_tokens.weight.device) % 5000 + 1000
    return model.model.embed_tokens(ids)[None].to(torch.bfloat16)


def markdown(run: dict) -> str:
    """README table of one saved run."""
    counts = sorted({r["prompt_tokens"] for r in run["rows"] if "prompt_tokens" in r})
    n_tokens = f" ({' / '.join(map(str, counts))} tokens)" if counts else ""  # runs saved before: words only
    lines = [f"{run['device']}, torch {run['torch']}, ComfyUI {run['comfyui']}; copy bandwidth "
             f"{run['copy_bw_Bps'] / 1e12:.2f} TB/s; prompt of {run['prompt']} words{n_tokens}, greedy",
             "", "| file | path | max_length | tok/s | ms/token | floor ms (% of floor) | peak VRAM GB "
             "| first token s | end-to-end tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    first = []
    if any(r["kind"] == "accept" for r in run["rows"]):
        from benchmarks.mtp_accept import table

        lines[0] = lines[0].replace(", greedy", "")
        lines[2:] = ["MTP at forced acceptance P (tok/s; `--accept`):", "", table(run["rows"]), ""] + lines[2:]
    for r in run["rows"]:
        if r["kind"] in ("profile", "prefill_profile") or r["kind"].startswith(("timeline", "host_profile", "accept")):
            # lists, not timed rows
            continue
        if r["kind"].startswith("first-use"):  # a warm-up's wall time, below the table
            first.append(f"{r['format']} {r['kind']}: {r['tokens']} tokens in {r['wall_s']:.2f} s")
            continue
        # The floor is one step's weight read; forced MTP rows make 4 tokens a step (plus 3 head steps).
        pct = "per step" if "forced" in r["kind"] else f"{r['floor_pct']:.0f}%"
        wait = (f"{r['first_token_s']:.2f} | {r['end_to_end_tok_s']:.1f}" if "wall_s" in r
                else "- | -")  # runs saved before these were recorded
        lines.append(f"| {r['format']} | {r['kind']} | {r['max_length']} | {r['tok_s']:.1f} | {r['ms_per_token']:.2f} "
                     f"| {r['floor_ms']:.2f} ({pct}) | {r['peak_gb']:.2f} | {wait} |")
    if first:
        lines += ["", "First generations of the process (the warm-ups): " + "; ".join(first) + "."]
    medians = compare(run["rows"])
    if medians:
        lines += ["", "| file | max_length | path | runs | median tok/s | against pack (forced3) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {m['format']} | {m['max_length']} | {m['kind']} | {m['runs']} | {m['tok_s']:.1f} | "
                  f"{m['ratio']:.3f} |" for m in medians]
    return "\n".join(lines)


def compare(rows: list[dict]) -> list[dict]:
    """Median tok/s per (format, max_length, kind) of the pack and forced MTP-3 rows and their
    ``--variants``, with the ratio to that format's and max_length's ``pack`` (``pack-forced3``)
    median; empty unless some variant or a ``--repeat`` gave more than one such row there."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r["kind"].partition("@")[0] in ("pack", "pack-forced3"):
            groups.setdefault((r["format"], r["max_length"], r["kind"]), []).append(r["tok_s"])
    if all(len(v) == 1 for v in groups.values()) and not any("@" in key[2] for key in groups):
        return []
    out = []
    for (fmt, length, kind), values in groups.items():
        base = groups.get((fmt, length, kind.partition("@")[0]))
        med = statistics.median(values)
        out.append({"format": fmt, "max_length": length, "kind": kind, "runs": len(values), "tok_s": med,
                    "ratio": med / statistics.median(base) if base else float("nan")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", help="a ComfyUI tree (imported in process)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8", "fp8", *FOUR_BIT])
    ap.add_argument("--kinds", nargs="+", default=["core", "pack", "forced3", "standalone"])
    ap.add_argument("--max-lengths", nargs="+", type=int, default=[4096, 24000, 65536])
    ap.add_argument("--core-max-lengths", nargs="+", type=int, default=[4096, 24000])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--core-tokens", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=960, help="prompt words (about 2.6 tokens each: 960 -> 2472 tokens)")
    ap.add_argument("--size", choices=["9b", "0.8b"], default="9b")
    ap.add_argument("--dir", default="/dev/shm/qwen35_comfy_e2e")
    ap.add_argument("--dynamic", action="store_true", help="load through DynamicVRAM (needs comfy-aimdo)")
    ap.add_argument("--loader", choices=["pack", "core"], default="pack",
                    help="pack: the pack's loader (resident, the file's MTP head grafted); core: core "
                         "load_clip, as core 'Load CLIP' (with --dynamic: streamed, and the patch reloads it; "
                         "no grafted MTP head, so no MTP kinds)")
    ap.add_argument("--profile", action="store_true",
                    help="also list the kernels of an eager 1-row decode step per format (torch profiler)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="also time the prompt's prefill and list its kernels and host ops per format")
    ap.add_argument("--memory", action="store_true",
                    help="at the first max_length, list what the core and pack rows allocate at their peak")
    ap.add_argument("--timeline", action="store_true",
                    help="also trace the pack's kernels per token of a generation, with and without PDL")
    ap.add_argument("--variants", nargs="+", type=parse_variant, default=[], metavar="NAME:TABLE.json",
                    help="extra MTP-off pack rows (kind pack@NAME), each run with this launch table pinned over "
                         "the GPU's own (kernels/launch.py), right after the pack row of each max_length; with "
                         "forced3 in --kinds also forced MTP-3 rows (pack-forced3@NAME) right after the forced3 row")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each max_length's rows this many times over, in the same interleaved order")
    ap.add_argument("--accept", nargs="+", type=float, metavar="P",
                    help="instead of the rows above: MTP off, depths 1..5 and auto with each draft kept with "
                         "probability P (benchmarks/mtp_accept.py); each generation ends at --tokens tokens")
    ap.add_argument("--accept-modes", nargs="+", choices=["greedy", "sampled"], default=["greedy", "sampled"])
    ap.add_argument("--no-triton", action="store_true",
                    help="run with `import triton` failing, as a Windows ComfyUI without triton-windows "
                         "(benchmarks/without_triton.py); rows are named <kind>-notriton")
    ap.add_argument("--json", default="comfy_e2e.json")
    ap.add_argument("--report", metavar="JSON", help="print the README table of a saved run and exit")
    args = ap.parse_args()
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return
    if not args.comfyui:
        ap.error("--comfyui is required")
    if args.no_triton and not triton_hidden():
        restart_without_triton(__file__)
    mtp_kinds = sorted({"forced3", "mtp-sampled"} & set(args.kinds))
    if args.loader == "core" and mtp_kinds:
        ap.error(f"--loader core loads no MTP head: drop {' '.join(mtp_kinds)} from --kinds")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    comfy = setup_comfyui(args.comfyui, args.dynamic)
    clock = TokenClock(comfy.utils)
    device = comfy.model_management.get_torch_device()
    cfg = config_9b() if args.size == "9b" else config_08b()
    bw = copy_bandwidth() if torch.cuda.is_available() else 0.0
    run = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "comfyui": _comfy_version(args.comfyui), "copy_bw_Bps": bw,
           "prompt": args.prompt, "size": args.size, "dynamic": args.dynamic, "loader": args.loader,
           "triton": not triton_hidden(), "rows": []}
    for fmt in args.formats:
        path = Path(args.dir) / f"qwen35_{args.size}_{fmt}.safetensors"
        if not path.exists():
            t0 = time.perf_counter()
            write_checkpoint(path, fmt, cfg, device)
            print(f"# wrote {path} ({path.stat().st_size / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        run["rows"] += bench_format(comfy, fmt, path, args, clock, bw)
        Path(args.json).write_text(json.dumps(run, indent=1))
    print(markdown(run))


def _comfy_version(tree: str) -> str:
    try:
        text = (Path(tree) / "comfyui_version.py").read_text()
        return text.split('"')[1]
    except (OSError, IndexError):
        return os.path.basename(tree)


if __name__ == "__main__":
    main()
