"""GPU, inside a real ComfyUI in process (``QWEN35_FAST_COMFYUI=<ComfyUI tree>``): the fast path on
models loaded by ComfyUI's own loader (``comfy.sd.load_clip`` through the pack's loader), random
0.8B checkpoints in ComfyUI's bf16, int8_convrot and fp8 (float8_e4m3fn) formats written by
``benchmarks/comfy_e2e.py``.

* the fast path is what runs (every projection read in place, CUDA graphs on: the engine's log
  line), and its greedy tokens equal the module path's (the same ComfyUI modules called per
  projection, no fused kernels, no graphs) in float32 execution, MTP off and on (int8: the
  weights are read as stored in either dtype);
* a soak: 100 generations alternating the patched clone (MTP off / 3), the unpatched CLIP (core),
  interrupts, partial offloads (made resident again by the next generation) and
  ``unload_all_models()`` + reload: repeated requests give identical tokens, allocated VRAM after
  a generation stays flat, and a reloaded model (new weight storage) is read afresh.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from tests.oracles.comfy_tree import GREEDY, import_comfyui, log_lines

COMFY = os.environ.get("QWEN35_FAST_COMFYUI")
pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not COMFY, reason="set QWEN35_FAST_COMFYUI=<ComfyUI checkout> to run")]

SOAK = 100  # generations (every 4th one interrupted, every 12th after unload_all_models)


@pytest.fixture(scope="module")
def comfy():
    return import_comfyui(COMFY)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, comfy):
    from benchmarks.comfy_e2e import config_08b, write_checkpoint

    out = {}
    folder = tmp_path_factory.mktemp("ckpt")
    for fmt in ("bf16", "int8", "fp8"):
        out[fmt] = folder / f"qwen35_08b_{fmt}.safetensors"
        write_checkpoint(out[fmt], fmt, config_08b(), "cuda", decisive=False, seed=7)
    return out


def _load(path):
    from qwen35_fast.patches.clip_loader import load_qwen35_clip

    return load_qwen35_clip(str(path), None).clip


@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp8"])
def test_fast_path_chosen_and_equal_to_module_path(comfy, checkpoints, caplog, fmt):
    from qwen35_fast.engine import generate
    from qwen35_fast.kernels.capabilities import fp8_reason
    from qwen35_fast.patches import comfy_bridge as bridge
    from qwen35_fast.patches.clip_patch import patch_clip

    if fmt == "fp8" and fp8_reason("cuda") is not None:
        pytest.skip(fp8_reason("cuda"))
    clip = _load(checkpoints[fmt])
    patched = patch_clip(clip, mtp="off")
    tokens = clip.tokenize("a lighthouse on a cliff at dusk, " * 12)
    caplog.set_level(logging.INFO)
    out = patched.generate(tokens, max_length=24, **GREEDY)
    lines = log_lines(caplog, "decode path")
    assert lines and " 0 of" not in lines[-1] and "through their module call" not in lines[-1], lines
    assert "CUDA graphs on" in lines[-1], lines[-1]
    assert len(out) >= 1
    target = bridge.find_qwen35(patched)
    device = comfy.model_management.get_torch_device()
    embeds, _ = bridge.prompt_embeds(target, tokens, device)
    kw = dict(max_length=32, stop_tokens=[], weight_cast=bridge.comfy_weight_cast, weights=bridge.WEIGHTS, **GREEDY)
    dtypes = (torch.bfloat16,) if fmt == "bf16" else (torch.float32, torch.bfloat16)
    if fmt == "fp8":  # the module path dequantizes (weight-only, as the fast path), no fp8 activations
        for m in target.transformer.modules():
            if getattr(m, "quant_format", None) == "float8_e4m3fn":
                m._full_precision_mm = True
    for dtype in dtypes:
        module = generate(target.transformer, embeds, execution_dtype=dtype, mtp="off", fused=False,
                          cuda_graphs=False, **kw)
        caplog.clear()
        fast = generate(target.transformer, embeds, execution_dtype=dtype, mtp="off", **kw)
        line = log_lines(caplog, "decode path")[-1]
        # float32 steps read the 8-bit rows in place; the bf16 head / embedding are cast by their modules
        kind = "int8+ConvRot" if fmt == "int8" else "float8_e4m3fn"
        assert ("CUDA graphs on" in line) if dtype == torch.bfloat16 else (kind in line), line
        if dtype == torch.float32:  # same math in float32: the same greedy tokens
            assert fast.tokens == module.tokens, (fmt, dtype)
            spec = generate(target.transformer, embeds, execution_dtype=dtype, mtp=3, **kw)
            assert spec.tokens == module.tokens and spec.stats.drafted > 0
        else:  # bf16 rounds differently in a GEMV and in ComfyUI's matmul: the first decode step agrees
            assert fast.tokens[:2] == module.tokens[:2], (fmt, dtype, fast.tokens, module.tokens)
    comfy.model_management.unload_all_models()


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_without_triton_graphs_equal_the_triton_path(comfy, checkpoints, tmp_path, fmt):
    """With ``import triton`` failing (a fresh process through ``benchmarks/without_triton.py``, as on a
    Windows ComfyUI without triton-windows), the module path runs in CUDA graphs with a graph-safe
    attention (kitchen's decode kernel or the bucketed one) and gives, in float32, the tokens of the
    eager module path there and of the Triton path here, MTP off and on."""
    import subprocess
    import sys

    from qwen35_fast.engine import generate
    from qwen35_fast.patches import comfy_bridge as bridge

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "notriton.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "without_triton.py"),
                    str(root / "tests" / "comfyui" / "notriton_child.py"), COMFY, str(checkpoints[fmt]), str(out)],
                   check=True, cwd=root, timeout=900)
    child = json.loads(out.read_text())
    for name in ("graphs", "graphs_mtp3", "graphs_bf16"):
        path = child[name]["path"]
        assert "every layer through its module calls" in path and "CUDA graphs on" in path, (name, path)
        assert "attention 'bucket'" in path or "attention 'kitchen'" in path, path
        assert not child[name]["warnings"], child[name]["warnings"]
    assert child["graphs"]["tokens"] == child["eager"]["tokens"] == child["graphs_mtp3"]["tokens"]
    clip = _load(checkpoints[fmt])
    target = bridge.find_qwen35(clip)
    comfy.model_management.load_models_gpu([clip.patcher], force_full_load=True)
    embeds, _ = bridge.prompt_embeds(target, clip.tokenize("a lighthouse on a cliff at dusk, " * 12),
                                     comfy.model_management.get_torch_device())
    triton = generate(target.transformer, embeds, execution_dtype=torch.float32, mtp="off", max_length=32,
                      stop_tokens=[], weight_cast=bridge.comfy_weight_cast, weights=bridge.WEIGHTS, **GREEDY)
    assert child["graphs"]["tokens"] == triton.tokens
    comfy.model_management.unload_all_models()


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "no-triton"])
def test_loop_run(tmp_path, triton):
    """``benchmarks/loop_run.py`` at a small scale (0.8B int8, a 4 GB budget, a 3 GB stand-in image model),
    with and without Triton: three prompts, each evicting the image model for the enhancer and the
    enhancer for the image model, never out of memory; every prompt's tokens (sampled, one seed) equal
    the first's; the enhancer's moves go through the swap patcher's pinned mirror (to the GPU as copies
    of its whole size, back to the host with no copy) within ComfyUI's pinned-memory limit. The
    bandwidths are reported, not asserted (a benchmark measures them)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "loop.json"
    cmd = [sys.executable, str(root / "benchmarks" / "loop_run.py"), "--comfyui", COMFY, "--size", "0.8b",
           "--budget-gb", "4", "--image-gb", "3", "--tokens", "24", "--prompts", "3", "--dir", str(tmp_path),
           "--json", str(out)] + ([] if triton else ["--no-triton"])
    subprocess.run(cmd, check=True, cwd=root, timeout=900)
    result = json.loads(out.read_text())
    assert result["tokens_equal"] and result["triton"] == triton, result
    rows = result["rows"]
    assert all(r["peak_gb"] <= 4.0 and r["tokens"] == 24 for r in rows), rows
    assert all(r["pinned_gb"] <= result["max_pinned_gb"] for r in rows)
    for r in rows[1:]:  # the image model was on the card: both moves happened, each way
        assert r["evict_image_s"] > 0 and r["load_enhancer_s"] > 0 and r["evict_enhancer_s"] > 0, r
        load, evict = r["enhancer_load_move"], r["enhancer_evict_move"]
        assert load["direction"] == "to the GPU" and load["bytes"] > 0 and load["unmirrored"] == 0, load
        assert evict["direction"] == "to the host" and evict["copied"] == 0 and evict["kept"] > 0, evict


def test_soak_inside_comfyui(comfy, checkpoints, caplog):
    from qwen35_fast.patches.clip_patch import patch_clip

    mm = comfy.model_management
    clip = _load(checkpoints["int8"])
    tokens = clip.tokenize("an old map of a harbour town, ink on paper, " * 10)
    off, mtp3 = patch_clip(clip, mtp="off"), patch_clip(clip, mtp=3)
    ref = {"off": off.generate(tokens, max_length=40, **GREEDY),
           "mtp3": mtp3.generate(tokens, max_length=40, **GREEDY),
           "core": clip.generate(tokens, max_length=12, **GREEDY)}
    assert ref["mtp3"] == ref["off"]  # exact MTP
    original = comfy.utils.ProgressBar.update_absolute

    def interrupt_at(n):
        def update_absolute(bar, value, total=None, preview=None):
            original(bar, value, total, preview)
            if value >= n:
                mm.interrupt_current_processing(True)
        return update_absolute

    allocated = []
    for i in range(SOAK):
        kind = ("off", "mtp3", "core", "interrupt")[i % 4]
        if i % 12 == 11:
            mm.unload_all_models()  # the next generation loads the model again (new weight storage)
        elif i % 12 == 5:
            clip.patcher.partially_unload(clip.patcher.offload_device, 64 * 2**20)  # made resident again
        if kind == "interrupt":
            comfy.utils.ProgressBar.update_absolute = interrupt_at(5)
            try:
                with pytest.raises(mm.InterruptProcessingException):
                    off.generate(tokens, max_length=40, **GREEDY)
            finally:
                comfy.utils.ProgressBar.update_absolute = original
                mm.interrupt_current_processing(False)
            continue
        caplog.clear()
        caplog.set_level(logging.INFO)
        model = {"off": off, "mtp3": mtp3, "core": clip}[kind]
        got = model.generate(tokens, max_length=12 if kind == "core" else 40, **GREEDY)
        assert got == ref[kind], (i, kind)
        if kind != "core":
            line = log_lines(caplog, "decode path")[-1]
            assert "through their module call" not in line and "CUDA graphs on" in line, (i, line)
            gc.collect()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
    steady = allocated[2:]
    assert max(steady) <= min(steady) * 1.01, [a / 2**20 for a in allocated]
    mm.unload_all_models()


def test_benchmark_checkpoint_loads_as_comfyui_int8(comfy, checkpoints):
    """The benchmark's int8 file is what ComfyUI's int8 path loads: QuantizedTensor Linear weights."""
    clip = _load(checkpoints["int8"])
    from qwen35_fast.patches import comfy_bridge as bridge

    target = bridge.find_qwen35(clip)
    layer = target.model.layers[0].mlp.gate_proj
    assert getattr(layer.weight, "_layout_cls", None) == "TensorWiseINT8Layout"
    assert Path(checkpoints["int8"]).stat().st_size < Path(checkpoints["bf16"]).stat().st_size
