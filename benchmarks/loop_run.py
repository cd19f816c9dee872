"""The prompt a user waits for (GPU): the enhancer and an image model taking turns on a 16 or 24 GB card.

The real loop inside a real ComfyUI, in process, prompt after prompt: the prompt enhancer (the pack's
loader, the enhancer node's own function ``enhance`` at its text-to-image preset, a fixed seed, an
answer of ``--tokens`` tokens) -> the image model (a stand-in of ``--image-gb`` of bf16 Linear weights in
ComfyUI's ops, loaded through ``load_models_gpu`` as a sampler loads its model, then one pass that reads
every weight) -> the next prompt. The process is capped at ``--budget-gb`` twice over (torch's allocator
and ComfyUI's own accounting, ``--reserve-vram`` of the rest), so ComfyUI evicts one model to load the
other, as on the smaller card.

Each move is timed apart (a CUDA synchronization on both sides of ComfyUI's own ``LoadedModel.model_unload``
/ ``model_load``): evicting the image model, loading the enhancer, evicting the enhancer, loading the image
model. Per prompt: those four, the enhancer's return (the first two), its first token and decode, the
image's return (the last two) and its pass, the wall time; the peak VRAM; ComfyUI's pinned host bytes.
Once per run: the host-to-device copy bandwidth from pinned and from pageable memory (1 GiB, median of
events), the floor of a move (the enhancer's bytes at the pinned bandwidth), and whether every prompt's
tokens equal the first's (sampled, one seed: the same text each time).

    python benchmarks/loop_run.py --comfyui /path/to/ComfyUI [--budget-gb 16] [--image-gb 12]
        [--format int8|w4a4] [--prompts 3] [--tokens 2000] [--swap on|off] [--no-triton] [--mtp off]
        [--size 9b|0.8b] [--json out.json]

``--swap off``: the pack's swap patcher is not installed (ComfyUI moves the enhancer itself), for the
before / after table in one GPU session. ``--no-triton``: the whole run with ``import triton`` failing
(``benchmarks/without_triton.py``). Exit status 1 when a prompt's tokens differ from the first's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from benchmarks.comfy_e2e import TokenClock, config_08b, write_checkpoint  # noqa: E402
from benchmarks.decode_e2e import config_9b  # noqa: E402
from benchmarks.without_triton import hidden as triton_hidden  # noqa: E402
from benchmarks.without_triton import restart as restart_without_triton  # noqa: E402

GIB = 2**30
FORMATS = {"int8": "int8", "w4a4": "w4a4"}
SYSTEM = " ".join(f"Rule {i}: describe colour{i % 13}, light{i % 7} and the subject's shape{i % 5}."
                  for i in range(160))
PROMPT = "A lighthouse on a cliff at dusk, waves below, gulls in the wind, a warm lamp in the window."


def h2d_bandwidth() -> dict:
    """Host-to-device copy bandwidth (bytes/s) from pinned and from pageable memory: 1 GiB copied
    8 times each, median of the last 6, timed with events."""
    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=(kind == "pinned"))
        host.random_(0, 255)
        times = []
        for _ in range(8):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dev.copy_(host, non_blocking=True)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        out[kind] = n / statistics.median(times[2:])
        del host
    del dev
    torch.cuda.empty_cache()
    return out


def setup_budget(tree: str, budget_gb: float):
    """Import ComfyUI from ``tree`` with ``budget_gb`` of this GPU: the rest reserved for ComfyUI's
    accounting (before ``comfy.model_management`` reads it) and refused by torch's allocator."""
    total = torch.cuda.get_device_properties(0).total_memory
    if budget_gb * GIB >= total:
        raise SystemExit(f"--budget-gb {budget_gb} is not below this GPU's {total / GIB:.1f} GiB")
    sys.path.insert(0, tree)
    import comfy.cli_args

    comfy.cli_args.args.reserve_vram = (total - budget_gb * GIB) / GIB
    torch.cuda.set_per_process_memory_fraction(budget_gb * GIB / total, 0)
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    import comfy.sd
    import comfy.utils

    return comfy


def image_standin(comfy, gb: float):
    """A ModelPatcher over ``gb`` of bf16 Linear weights (ComfyUI's manual_cast ops, on the CPU), as an
    image model waits to be loaded; and its pass, which reads every weight once (one row through each)."""
    n = 8192
    layers = max(1, round(gb * GIB / (n * n * 2)))
    ops = comfy.ops.manual_cast
    model = torch.nn.Sequential(*[ops.Linear(n, n, bias=False, dtype=torch.bfloat16, device="cpu")
                                  for _ in range(layers)])
    mm = comfy.model_management
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                               offload_device=mm.unet_offload_device())

    @torch.no_grad()
    def run_pass():
        x = torch.ones(1, n, dtype=torch.bfloat16, device=mm.get_torch_device())
        for layer in model:
            x = layer(x)
            x = x / x.float().abs().amax().clamp_min(1e-6).to(x.dtype)
        torch.cuda.synchronize()

    return patcher, run_pass


class MoveTimer:
    """Times ComfyUI's ``LoadedModel.model_unload`` / ``model_load`` (synchronized on both sides) and
    names each after the model it moved (``enhancer`` / ``image``)."""

    def __init__(self, comfy, enhancer_model):
        self.events: list[tuple[str, str, float]] = []
        lm = comfy.model_management.LoadedModel
        timer = self

        def timed(fn, what):
            def call(loaded, *args, **kwargs):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                try:
                    return fn(loaded, *args, **kwargs)
                finally:
                    torch.cuda.synchronize()
                    who = "enhancer" if loaded.model.model is enhancer_model else "image"
                    timer.events.append((what, who, time.perf_counter() - t0))
            return call

        lm.model_unload = timed(lm.model_unload, "evict")
        lm.model_load = timed(lm.model_load, "load")

    def take(self) -> dict:
        """Seconds per (move, model) since the last call, e.g. ``evict_image_s``; then forgets them."""
        out: dict[str, float] = {}
        for what, who, s in self.events:
            out[f"{what}_{who}_s"] = out.get(f"{what}_{who}_s", 0.0) + s
        self.events.clear()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", required=True)
    ap.add_argument("--budget-gb", type=float, default=16.0)
    ap.add_argument("--image-gb", type=float, default=None, help="default: the budget less 4 GB")
    ap.add_argument("--format", choices=sorted(FORMATS), default="int8")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--swap", choices=["on", "off"], default="on")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--mtp", default="off")
    ap.add_argument("--size", choices=["9b", "0.8b"], default="9b")
    ap.add_argument("--dir", default="/dev/shm/qwen35_comfy_e2e")
    ap.add_argument("--json", default="loop_run.json")
    args = ap.parse_args()
    if args.no_triton and not triton_hidden():
        restart_without_triton(__file__)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    image_gb = args.image_gb if args.image_gb is not None else args.budget_gb - 4
    path = Path(args.dir) / f"qwen35_{args.size}_{args.format}.safetensors"
    if not path.exists():  # built on the GPU before the cap (a 9B in bf16 is 18 GB)
        write_checkpoint(path, FORMATS[args.format], config_9b() if args.size == "9b" else config_08b(), "cuda")
        torch.cuda.empty_cache()
    bandwidth = h2d_bandwidth()
    comfy = setup_budget(args.comfyui, args.budget_gb)
    from qwen35_fast.enhancer.prompt_enhancer import enhance
    from qwen35_fast.patches import swap_patcher
    from qwen35_fast.patches.clip_loader import load_qwen35_clip

    if args.swap == "off":  # ComfyUI's own moves, for the before / after table
        swap_patcher.install = lambda patcher: "off (--swap off)"
    mm = comfy.model_management
    clock = TokenClock(comfy.utils)
    clip = load_qwen35_clip(str(path), None).clip
    enhancer_model = clip.patcher.model
    timer = MoveTimer(comfy, enhancer_model)
    enhancer_bytes = clip.patcher.model_size()
    image, image_pass = image_standin(comfy, image_gb)
    rows, first_tokens = [], None
    for k in range(args.prompts):
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        timer.take()
        mm.load_models_gpu([clip.patcher])
        back = timer.take()
        return_s = time.perf_counter() - t0
        with StreamedTokens() as seen:
            t1 = time.perf_counter()
            try:
                decode_tok_s = clock.run(lambda: enhance(clip, PROMPT, system_prompt=SYSTEM, max_length=args.tokens,
                                                         seed=42, mtp=args.mtp), args.tokens, stop=False)
                ended = None
            except RuntimeError as exc:  # the model wrote a stop token before --tokens
                decode_tok_s, ended = 0.0, str(exc)
            enhance_s = time.perf_counter() - t1
        during = timer.take()
        move = swap_patcher.last_move(enhancer_model)
        t2 = time.perf_counter()
        mm.load_models_gpu([image])
        image_back = timer.take()
        image_return_s = time.perf_counter() - t2
        evicted = swap_patcher.last_move(enhancer_model)
        t3 = time.perf_counter()
        image_pass()
        pass_s = time.perf_counter() - t3
        tokens = seen.tokens
        first_tokens = tokens if first_tokens is None else first_tokens
        row = {"prompt": k + 1, "return_s": return_s, **back, "first_token_s": clock.last.get("first_token_s"),
               "decode_s": (clock.last.get("wall_s", enhance_s) - clock.last.get("first_token_s", 0.0)),
               "decode_tok_s": decode_tok_s, "enhance_s": enhance_s, "moves_during_enhance": during,
               "tokens": len(tokens), "ended_early": ended, "image_return_s": image_return_s, **image_back,
               "image_pass_s": pass_s, "wall_s": time.perf_counter() - t0,
               "peak_gb": torch.cuda.max_memory_allocated() / GIB,
               "pinned_gb": getattr(mm, "TOTAL_PINNED_MEMORY", 0) / GIB,
               "enhancer_load_move": move, "enhancer_evict_move": evicted, "tokens_equal_first": tokens == first_tokens}
        rows.append(row)
        print(f"prompt {k + 1}: return {return_s:.2f} s {back}; first token {row['first_token_s'] or 0:.2f} s, "
              f"decode {row['decode_s']:.2f} s ({decode_tok_s:.1f} tok/s, {len(tokens)} tokens); image return "
              f"{image_return_s:.2f} s {image_back}, pass {pass_s:.2f} s; wall {row['wall_s']:.2f} s; peak "
              f"{row['peak_gb']:.2f} GB, pinned {row['pinned_gb']:.2f} GB", flush=True)
    floor_s = enhancer_bytes / bandwidth["pinned"]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": not triton_hidden(),
              "comfyui": args.comfyui, "budget_gb": args.budget_gb, "image_gb": image_gb, "format": args.format,
              "size": args.size, "swap": args.swap, "mtp": args.mtp, "tokens": args.tokens,
              "enhancer_gb": enhancer_bytes / GIB, "h2d_pinned_gbps": bandwidth["pinned"] / 1e9,
              "h2d_pageable_gbps": bandwidth["pageable"] / 1e9, "move_floor_s": floor_s,
              "max_pinned_gb": getattr(mm, "MAX_PINNED_MEMORY", 0) / GIB, "rows": rows,
              "tokens_equal": all(r["tokens_equal_first"] for r in rows)}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(result), flush=True)
    if not result["tokens_equal"]:
        raise SystemExit("a prompt's tokens differ from the first prompt's")


def table(result: dict) -> str:
    """The run as a markdown table, steady-state prompts (2..K) only when there are several."""
    rows = result["rows"][1:] or result["rows"]
    head = (f"{result['device']}, budget {result['budget_gb']:g} GB, image {result['image_gb']:g} GB, "
            f"{result['format']}, swap {result['swap']}, Triton {'on' if result['triton'] else 'off'}; "
            f"H2D pinned {result['h2d_pinned_gbps']:.1f} GB/s, pageable {result['h2d_pageable_gbps']:.1f} GB/s; "
            f"enhancer {result['enhancer_gb']:.2f} GiB, floor {result['move_floor_s']:.3f} s")
    cols = ["evict_image_s", "load_enhancer_s", "return_s", "first_token_s", "decode_s", "evict_enhancer_s",
            "load_image_s", "image_return_s", "wall_s", "peak_gb", "pinned_gb"]
    lines = [head, "| prompt | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r['prompt']} | " + " | ".join(f"{r.get(c) or 0:.3f}" for c in cols) + " |")
    return "\n".join(lines)


class StreamedTokens:
    """While open, records the tokens the pack's progress callback sees (``comfy_bridge.Progress``,
    called once per step with every token so far) in ``tokens``."""

    def __enter__(self):
        from qwen35_fast.patches import comfy_bridge

        self.cls, self.original, self.tokens = comfy_bridge.Progress, comfy_bridge.Progress.__call__, []
        probe = self

        def call(progress, all_tokens, new_tokens, stats):
            probe.tokens = list(all_tokens)
            return probe.original(progress, all_tokens, new_tokens, stats)

        self.cls.__call__ = call
        return self

    def __exit__(self, *exc):
        self.cls.__call__ = self.original
        return False


if __name__ == "__main__":
    main()
