"""The no-Triton half of ``test_comfyui_gpu.test_without_triton_graphs_equal_the_triton_path``, run in
a fresh process through ``benchmarks/without_triton.py`` (``import triton`` fails, as on a Windows
ComfyUI without triton-windows): ``notriton_child.py TREE CHECKPOINT OUT.json``.

Loads the checkpoint with the pack's loader in that ComfyUI and writes, per run, the greedy tokens
and the engine's decode-path line: ``eager`` (the module path, no graphs), ``graphs`` (what runs by
default without Triton: the module path in CUDA graphs), ``graphs_mtp3``, all float32 execution, and
``graphs_bf16`` (the execution dtype ComfyUI picks on the GPU).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _standalone import load_pack  # noqa: E402

load_pack()
import torch  # noqa: E402

from tests.oracles.comfy_tree import GREEDY, import_comfyui  # noqa: E402
from tests.oracles.log_messages import Messages  # noqa: E402

PROMPT = "a lighthouse on a cliff at dusk, " * 12


def main(tree: str, checkpoint: str, out: str) -> None:
    import importlib.util

    assert importlib.util.find_spec("triton") is None, "run through benchmarks/without_triton.py"
    comfy = import_comfyui(tree)
    from qwen35_fast.engine import generate
    from qwen35_fast.patches import comfy_bridge as bridge
    from qwen35_fast.patches.clip_loader import load_qwen35_clip

    lines = Messages()
    logging.getLogger("qwen35_fast").addHandler(lines)
    logging.getLogger("qwen35_fast").setLevel(logging.INFO)
    clip = load_qwen35_clip(checkpoint, None).clip
    target = bridge.find_qwen35(clip)
    device = comfy.model_management.get_torch_device()
    comfy.model_management.load_models_gpu([clip.patcher], force_full_load=True)
    embeds, _ = bridge.prompt_embeds(target, clip.tokenize(PROMPT), device)
    kw = dict(max_length=32, stop_tokens=[], weight_cast=bridge.comfy_weight_cast, weights=bridge.WEIGHTS, **GREEDY)
    runs = {"eager": dict(execution_dtype=torch.float32, mtp="off", fused=False, cuda_graphs=False),
            "graphs": dict(execution_dtype=torch.float32, mtp="off"),
            "graphs_mtp3": dict(execution_dtype=torch.float32, mtp=3),
            "graphs_bf16": dict(execution_dtype=torch.bfloat16, mtp="off")}
    result = {}
    for name, extra in runs.items():
        lines.messages.clear()
        res = generate(target.transformer, embeds, **extra, **kw)
        path = [x for x in lines.messages if "decode path" in x]
        result[name] = {"tokens": res.tokens, "path": path[-1] if path else "",
                        "warnings": [x for x in lines.messages if "without CUDA graphs" in x]}
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
