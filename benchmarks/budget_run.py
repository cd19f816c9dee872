"""The enhancer on a GPU budget inside a real ComfyUI (GPU): a 16 GB card's run on a bigger GPU.

What a 16 GB desktop user does: the prompt enhancer on the 9B int8 file (the pack's loader, the patch
as the enhancer uses it, greedy, max_length 16256), then an image model that needs most of the card
(a 12 GB stand-in loaded through ComfyUI's own ``load_models_gpu``, as Qwen-Image would be), then the
enhancer again. The process is capped at the budget twice over: torch's allocator
(``torch.cuda.set_per_process_memory_fraction``: more raises out-of-memory) and ComfyUI's own
accounting (``--reserve-vram`` of the rest of the card, so ComfyUI offloads as it would on the
smaller card). Passes when nothing runs out of memory and the second run's greedy tokens equal
the first's; reports each run's first-token time, decode tok/s (from the 8th token) and where the
models were (ComfyUI's loaded list), and the process's peak allocation.

    python benchmarks/budget_run.py --comfyui /path/to/ComfyUI [--no-triton] [--budget-gb 16]
        [--standin-gb 12] [--max-length 16256] [--tokens 200] [--size 9b|0.8b] [--json out.json]

``--no-triton``: the whole run with ``import triton`` failing (``benchmarks/without_triton.py``).
Exit status 1 when the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _standalone import load_pack  # noqa: E402

load_pack()
from benchmarks.comfy_e2e import TokenClock, config_08b, prompt_tokens, write_checkpoint  # noqa: E402
from benchmarks.decode_e2e import config_9b  # noqa: E402
from benchmarks.without_triton import hidden as triton_hidden  # noqa: E402
from benchmarks.without_triton import restart as restart_without_triton  # noqa: E402

GIB = 2**30
GREEDY = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0,
              presence_penalty=0.0)


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


def standin(comfy, gb: float):
    """A ModelPatcher over ``gb`` of bf16 Linear weights (ComfyUI's manual_cast ops, on the CPU), as
    an image model waits to be loaded."""
    n = 8192
    layers = max(1, round(gb * GIB / (n * n * 2)))
    ops = comfy.ops.manual_cast
    model = torch.nn.Sequential(*[ops.Linear(n, n, bias=False, dtype=torch.bfloat16, device="cpu")
                                  for _ in range(layers)])
    mm = comfy.model_management
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def loaded(comfy) -> list[dict]:
    """ComfyUI's loaded models: class and GB on the GPU."""
    return [{"model": type(m.model.model).__name__, "gpu_gb": m.model.loaded_size() / GIB}
            for m in comfy.model_management.current_loaded_models]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", required=True)
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--budget-gb", type=float, default=16.0)
    ap.add_argument("--standin-gb", type=float, default=12.0)
    ap.add_argument("--max-length", type=int, default=16256)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=960, help="prompt words (960 -> 2472 tokens)")
    ap.add_argument("--size", choices=["9b", "0.8b"], default="9b")
    ap.add_argument("--dir", default="/dev/shm/qwen35_comfy_e2e")
    ap.add_argument("--json", default="budget_run.json")
    args = ap.parse_args()
    if args.no_triton and not triton_hidden():
        restart_without_triton(__file__)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = Path(args.dir) / f"qwen35_{args.size}_int8.safetensors"
    if not path.exists():  # built on the GPU before the cap (a 9B in bf16 is 18 GB)
        write_checkpoint(path, "int8", config_9b() if args.size == "9b" else config_08b(), "cuda")
        torch.cuda.empty_cache()
    comfy = setup_budget(args.comfyui, args.budget_gb)
    from qwen35_fast.patches.clip_loader import load_qwen35_clip
    from qwen35_fast.patches.clip_patch import patch_clip

    clock = TokenClock(comfy.utils)
    clip = load_qwen35_clip(str(path), None).clip
    patched = patch_clip(clip, mtp="off")
    tokens = prompt_tokens(clip, args.prompt)
    runs, outputs = [], []

    def enhance(label: str) -> None:
        with StreamedTokens() as seen:
            tok_s = clock.run(lambda: patched.generate(tokens, max_length=args.max_length, **GREEDY), args.tokens)
        outputs.append(seen.tokens[:args.tokens])
        runs.append({"run": label, "tok_s": tok_s, **clock.last, "loaded": loaded(comfy),
                     "peak_gb": torch.cuda.max_memory_allocated() / GIB})
        print(f"{label}: {tok_s:.1f} tok/s, first token {clock.last['first_token_s']:.2f} s; loaded "
              f"{runs[-1]['loaded']}", flush=True)

    torch.cuda.reset_peak_memory_stats()
    enhance("enhancer")
    t0 = time.perf_counter()
    image = standin(comfy, args.standin_gb)  # held, as a workflow holds its image model: ComfyUI's list is weak
    comfy.model_management.load_models_gpu([image])
    standin_s = time.perf_counter() - t0
    after_image = loaded(comfy)
    print(f"stand-in of {args.standin_gb} GB loaded in {standin_s:.1f} s; loaded {after_image}", flush=True)
    enhance("enhancer again")
    del image
    equal = len(outputs[0]) == args.tokens and outputs[0] == outputs[1]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": not triton_hidden(),
              "budget_gb": args.budget_gb, "standin_gb": args.standin_gb, "max_length": args.max_length,
              "size": args.size, "prompt_words": args.prompt, "runs": runs, "loaded_after_standin": after_image,
              "standin_load_s": standin_s, "peak_gb": torch.cuda.max_memory_allocated() / GIB,
              "tokens_equal": equal}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    if not equal:
        raise SystemExit("the second run's tokens differ from the first's")


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
